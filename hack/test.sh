#!/usr/bin/env bash
# The test command (README, .ci/run): builds or reuses the cached environment and
# tools, then runs every test tier that this machine can run. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/env.sh
set -euo pipefail
hack/system-tools.sh                # promtool
if [ -x hack/cluster-binaries.sh ]; then
  hack/cluster-binaries.sh          # Kubernetes control plane + helm, cached by version
fi
echo "ctj: ruff" >&2
ruff check trainer_sidecar operator tests bench hack examples
echo "ctj: pytest" >&2
exec python -m pytest -ra "$@"
