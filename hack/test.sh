#!/usr/bin/env bash
# The test command (README, .ci/run): builds or reuses the cached environment and
# tools, then runs every test tier that this machine can run. Extra arguments go to pytest.
#
# ./hack/test.sh --fast: lint, type checks and the unit tests only (no Go, no Docker, no
# cluster; under 2 minutes once the Python environment is built). Use it while you work.
#
# With no arguments, the three slow tiers run at once, in lanes (docs/e2e.md, "Three
# lanes"): each alone waits on Kubernetes timings, servers and polls about 40 % of its time,
# and each holds a cluster of a different kind (none; simulated nodes; kind), so they share
# only the cores. This process runs lint, then the unit and integration tiers; beside it
# the cluster tier (once its Go binaries are built) and the e2e tier (once its images and
# kind tools are: hack/stack-env.sh --prepare, in the background from the start). Their
# output is printed when all end. CTJ_SERIAL_TIERS=1 runs one tier after another.
#
# The e2e tier (tests/e2e) runs on a kind cluster of its own, ${CTJ_E2E_CLUSTER:-ctj-e2e}
# (the demo's cluster is left alone), made when the tier starts and deleted as soon as it
# ends (CTJ_E2E_KEEP_CLUSTER=1 keeps it). With arguments, the e2e tier's cluster is brought
# up only when they name e2e. Where no container runtime can run, the e2e tier skips with
# the reason in pytest's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
phase() { echo "ctj: [$(( $(date +%s) - t0 ))s] $*" >&2; }
lint() {
  phase "ruff"
  ruff check trainer_sidecar operator contract tests bench hack/ctj_devcluster hack/ctj_stack examples
  phase "mypy"
  mypy trainer_sidecar operator/ctj_operator contract/ctj_contract hack/ctj_devcluster hack/ctj_stack bench
}
if [[ "${1:-}" == "--fast" ]]; then
  shift
  source hack/env.sh
  set -euo pipefail
  hack/system-tools.sh              # promtool (a Debian package)
  lint
  phase "pytest (unit)"
  python -m pytest -q -ra tests/unit "$@"
  phase "done"
  exit 0
fi
# The Go builds (cached by version) need only bash and Go: on a cold machine they overlap
# the venv's build instead of following it. helm and SeaweedFS come first (--local): the
# unit and integration tiers need nothing else, so with no arguments those tiers run while
# the control plane and the controllers (the cluster tier's) still compile, niced
# (CTJ_BUILD_NICE), and then the e2e tier's images and kind tools are built.
bin_log=$(mktemp) bin_rc=$(mktemp) e2e_rc=$(mktemp)
hack/cluster-binaries.sh --local >"$bin_log" 2>&1 &
bin_pid=$!
source hack/env.sh
set -euo pipefail
hack/system-tools.sh                # promtool
wait "$bin_pid" || { cat "$bin_log" >&2; echo "ctj: building helm and SeaweedFS failed" >&2; exit 1; }
cat "$bin_log" >&2

e2e_cluster="${CTJ_E2E_CLUSTER:-ctj-e2e}"
e2e_env="$(mktemp)" e2e_log="$(mktemp)" e2e_made="" lanes=() lane_outs=()
cleanup() {
  rm -f "$e2e_env" "$e2e_log" "$bin_log" "$bin_rc" "$e2e_rc" "${lane_outs[@]}"
  rm -rf "${claims:-/nonexistent}"
  local pid
  for pid in "${lanes[@]}"; do  # interrupted: the lanes' tests end with this process
    if kill -0 "$pid" 2>/dev/null; then pkill -TERM -P "$pid" || true; kill "$pid" || true; fi
  done
  if [ -n "$e2e_made" ] && [ -z "${CTJ_E2E_KEEP_CLUSTER:-}" ]; then
    CTJ_KIND_CLUSTER="$e2e_cluster" hack/kind/cluster.sh down >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
# the rest of the binaries; its exit status lands in $bin_rc
build_rest() {
  local rc=0
  hack/cluster-binaries.sh >"$bin_log" 2>&1 || rc=$?
  echo "$rc" >"$bin_rc"
  return "$rc"
}
# wait for a background job that writes its exit status to a file (from any subshell:
# only the shell that started a job can `wait` for it); print that status
job_status() {
  local pid="$1" rc_file="$2"
  while [ ! -s "$rc_file" ] && kill -0 "$pid" 2>/dev/null; do sleep 1; done
  if [ -s "$rc_file" ]; then cat "$rc_file"; else echo 1; fi
}
# wait for build_rest (run in the background job $bin_pid), its log to stderr
built() {
  local rc
  rc="$(job_status "$bin_pid" "$bin_rc")"
  cat "$bin_log" >&2
  [ "$rc" = 0 ] || { echo "ctj: building the cluster binaries failed" >&2; exit 1; }
}
# the e2e tier's prerequisites, built (and a cluster left by an interrupted run deleted)
prepare_e2e() {
  hack/stack-env.sh --prepare || return $?
  CTJ_KIND_CLUSTER="$e2e_cluster" hack/kind/cluster.sh down
}
# wait for prepare_e2e, then make the cluster and export what stack-env printed (or why
# the tier skips)
e2e_ready() {
  local rc
  rc="$(job_status "$e2e_pid" "$e2e_rc")"
  cat "$e2e_log" >&2
  if (( rc == 3 )); then
    export CTJ_E2E_SKIP_REASON="$(cat "$e2e_env")"
    phase "the e2e tier will skip: $CTJ_E2E_SKIP_REASON"
    return 0
  elif (( rc != 0 )); then
    echo "ctj: building the e2e tier's prerequisites failed (exit $rc)" >&2; return "$rc"
  fi
  phase "creating the e2e tier's kind cluster $e2e_cluster"
  e2e_made=1
  CTJ_KIND_CLUSTER="$e2e_cluster" hack/stack-env.sh >"$e2e_env" \
    || { echo "ctj: bringing up the e2e cluster failed" >&2; return 1; }
  while IFS='=' read -r key value; do export "$key=$value"; done <"$e2e_env"
}
e2e_pid=""
if (( $# == 0 )) || [[ "$*" == *e2e* ]]; then
  phase "building the cluster tier's binaries, then the e2e tier's images and kind tools (logs follow when they are needed)"
  { rc=0; { build_rest && prepare_e2e; } || rc=$?; echo "$rc" >"$e2e_rc"; } \
    >"$e2e_env" 2>"$e2e_log" &
  bin_pid=$! e2e_pid=$!
else
  build_rest &
  bin_pid=$!
fi
# the e2e tier: its cluster made once its prerequisites are built, its tests, and the
# cluster deleted at once (in a subshell: the cluster's variables stay out of the others)
e2e_tier() {
  local rc=0
  e2e_ready || return $?
  phase "pytest (e2e tier, on kind)"
  python -m pytest -ra --durations=12 tests/e2e || rc=$?
  phase "pytest (e2e tier) ended (exit $rc)"
  if [ -z "${CTJ_E2E_KEEP_CLUSTER:-}" ]; then
    CTJ_KIND_CLUSTER="$e2e_cluster" hack/kind/cluster.sh down >/dev/null 2>&1 || true
  fi
  return "$rc"
}
# the cluster tier (the binaries' build log first)
cluster_tier() {
  local rc=0
  built
  phase "pytest (cluster tier)"
  python -m pytest -ra --durations=15 tests --ignore=tests/unit --ignore=tests/integration \
    --ignore=tests/e2e || rc=$?
  phase "pytest (cluster tier) ended (exit $rc)"
  return "$rc"
}
# Integration files that run apart from their tier's pytest, each in whichever lane is
# free first, the longest first: every lane, its own tier done, takes the next unclaimed
# one until none is left (mkdir is the atomic claim). They are long, stand alone (each
# starts its own servers) and together take about 10 minutes under three lanes, which
# evens the lanes' ends (docs/e2e.md, "Three lanes").
movable_tests=(
  tests/integration/test_chaos.py
  tests/integration/test_bench_restore_tier_smoke.py
  tests/integration/test_bench_async_smoke.py
  tests/integration/test_bench_finetune_smoke.py
  tests/integration/test_bench_smoke.py
  tests/integration/test_bench_s3_servers_smoke.py
)
claims="$(mktemp -d)"
run_unclaimed_tests() {
  local rc=0 one file
  for file in "${movable_tests[@]}"; do
    mkdir "$claims/${file##*/}" 2>/dev/null || continue
    phase "pytest ($file, in this lane)"
    one=0
    python -m pytest -ra --durations=5 "$file" || one=$?
    phase "pytest ($file) ended (exit $one)"
    rc=$(( rc ? rc : one ))
  done
  return "$rc"
}
# the cluster tier's lane, and the e2e tier's (its cluster's variables kept to a subshell)
cluster_lane() {
  local rc=0
  cluster_tier || rc=$?
  run_unclaimed_tests || rc=$(( rc ? rc : $? ))
  return "$rc"
}
e2e_lane() {
  local rc=0
  ( e2e_tier ) || rc=$?
  run_unclaimed_tests || rc=$(( rc ? rc : $? ))
  return "$rc"
}
lint
if (( $# == 0 )); then
  rc=0 apart_args=()
  # lane FUNCTION: run it in the background, its output to a file printed at the end
  lane() {
    local out; out="$(mktemp)"
    "$1" >"$out" 2>&1 &
    lanes+=("$!") lane_outs+=("$out")
  }
  if [ -z "${CTJ_SERIAL_TIERS:-}" ]; then
    phase "the cluster tier and the e2e tier run beside this one (their output: at the end)"
    e2e_made=1
    lane cluster_lane
    lane e2e_lane
    apart_args=("${movable_tests[@]/#/--ignore=}")
  fi
  # the slowest tests are listed: where the 90 minutes of CI go, in every CI log
  phase "pytest (unit and integration tiers)"
  python -m pytest -ra --durations=25 tests/unit tests/integration "${apart_args[@]}" || rc=$?
  phase "pytest (unit and integration tiers) ended (exit $rc)"
  if [ -n "${lanes[*]}" ]; then run_unclaimed_tests || rc=$(( rc ? rc : $? )); fi
  if [ -n "${CTJ_SERIAL_TIERS:-}" ]; then
    cluster_tier || rc=$(( rc ? rc : $? ))
    e2e_tier || rc=$(( rc ? rc : $? ))
  fi
  for i in "${!lanes[@]}"; do
    wait "${lanes[$i]}" || rc=$(( rc ? rc : $? ))
    cat "${lane_outs[$i]}" >&2
  done
  phase "done (exit $rc)"
  exit "$rc"
fi
built
if [ -n "$e2e_pid" ]; then e2e_ready; fi
phase "pytest"
python -m pytest -ra "$@"
