#!/usr/bin/env bash
# The main job, locally (README's first command): builds or reuses the cached
# environment, then runs the end-to-end demo on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/env.sh
set -euo pipefail
exec python examples/local_demo.py "$@"
