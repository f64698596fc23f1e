#!/usr/bin/env bash
# The test command (README, .ci/run): builds or reuses the cached environment and
# tools, then runs every test tier that this machine can run. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Go build of the control plane (cached by version) needs only bash and Go:
# on a cold machine it overlaps the venv build instead of following it.
bin_log=$(mktemp)
hack/cluster-binaries.sh >"$bin_log" 2>&1 &
bin_pid=$!
source hack/env.sh
set -euo pipefail
hack/system-tools.sh                # promtool
wait "$bin_pid" || { cat "$bin_log" >&2; echo "ctj: building the cluster binaries failed" >&2; exit 1; }
cat "$bin_log" >&2
echo "ctj: ruff" >&2
ruff check trainer_sidecar operator tests bench hack/ctj_devcluster hack/ctj_stack examples
echo "ctj: mypy" >&2
mypy trainer_sidecar operator/ctj_operator hack/ctj_devcluster hack/ctj_stack bench
echo "ctj: pytest" >&2
exec python -m pytest -ra "$@"
