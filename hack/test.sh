#!/usr/bin/env bash
# The test command (README, .ci/run): builds or reuses the cached environment and
# tools, then runs every test tier that this machine can run. Extra arguments go to pytest.
#
# The e2e tier (tests/e2e) runs on a kind cluster that hack/stack-env.sh brings up (our
# images on its nodes). With no arguments, that happens in the background while the other
# tiers run, and the e2e tier runs last; with arguments, only when they name e2e. Where
# no container runtime can run, the e2e tier skips with the reason in pytest's summary.
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

e2e_env="$(mktemp)" e2e_log="$(mktemp)"
trap 'rm -f "$e2e_env" "$e2e_log" "$bin_log"' EXIT
e2e_ready() {  # wait for stack-env, export what it printed (or why the tier skips)
  local rc=0
  wait "$e2e_pid" || rc=$?
  cat "$e2e_log" >&2
  if (( rc == 3 )); then
    export CTJ_E2E_SKIP_REASON="$(cat "$e2e_env")"
  elif (( rc != 0 )); then
    echo "ctj: bringing up the e2e cluster failed (exit $rc)" >&2; return "$rc"
  else
    while IFS='=' read -r key value; do export "$key=$value"; done <"$e2e_env"
  fi
}
e2e_pid=""
if (( $# == 0 )) || [[ "$*" == *e2e* ]]; then
  echo "ctj: bringing up the e2e tier's kind cluster (log follows when it is needed)" >&2
  hack/stack-env.sh >"$e2e_env" 2>"$e2e_log" &
  e2e_pid=$!
fi
if (( $# == 0 )); then
  echo "ctj: pytest (every tier but e2e)" >&2
  rc=0
  python -m pytest -ra --ignore=tests/e2e || rc=$?
  e2e_ready
  echo "ctj: pytest (e2e tier, on kind)" >&2
  python -m pytest -ra tests/e2e || rc=$(( rc ? rc : $? ))
  exit "$rc"
fi
if [ -n "$e2e_pid" ]; then e2e_ready; fi
echo "ctj: pytest" >&2
python -m pytest -ra "$@"
