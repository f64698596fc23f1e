#!/usr/bin/env bash
# The main job (README's first command): the operator demo on a local kind cluster.
# Builds or reuses everything it needs (Python env, Docker, our images, the kind cluster;
# cached, with progress), then installs the chart and the S3 server, applies the example
# job, stops a node, and prints the timeline of the recovery (hack/ctj_stack/demo.py).
#
#   ./hack/demo.sh [--keep]   on kind (--keep: leave the job training at the end)
#   ./hack/demo.sh --rounds 5 --hangs 5 --json F   the recovery benchmark on kind: budgets
#                             by phase, medians and spreads (docs/benchmarks.md)
#   ./hack/demo.sh --local    the engine-only demo, no cluster, no container runtime
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/env.sh
set -euo pipefail
if [ "${1:-}" = "--local" ]; then
  shift
  exec python examples/local_demo.py "$@"
fi
env_file="$(mktemp)"
trap 'rm -f "$env_file"' EXIT
rc=0
hack/stack-env.sh >"$env_file" || rc=$?
if (( rc == 3 )); then
  echo "ctj: $(cat "$env_file")" >&2
  echo "ctj: the engine-only demo needs none: ./hack/demo.sh --local" >&2
  exit 1
elif (( rc != 0 )); then
  exit "$rc"
fi
while IFS='=' read -r key value; do export "$key=$value"; done <"$env_file"
python -m ctj_stack demo "$@"
