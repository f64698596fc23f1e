#!/usr/bin/env bash
# Builds (once) ctj's images here, with no registry, and prints their names:
#
#   CTJ_OPERATOR_IMAGE=ctj/operator:<key>    the Dockerfile's operator target
#   CTJ_SIDECAR_IMAGE=ctj/sidecar:<key>      its sidecar target (the checkpoint sidecar the
#                                            operator adds to every pod: no torch)
#   CTJ_TRAINER_IMAGE=ctj/trainer:<key>      its trainer target (the training containers)
#   CTJ_SEAWEEDFS_IMAGE=ctj/seaweedfs:<key>  deploy/seaweedfs/Dockerfile, our S3 server
#   CTJ_KUBEFLOW_IMAGE=ctj/training-operator:<key>  deploy/kubeflow/Dockerfile, Kubeflow's
#                                            PyTorchJob controller (the pytorchjob backend)
#   CTJ_KUEUE_IMAGE=ctj/kueue:<key>          deploy/kueue/Dockerfile, Kueue's manager
#   CTJ_JOBSET_IMAGE=ctj/jobset:<key>        deploy/jobset/Dockerfile, JobSet's manager
#   CTJ_KUBEFLOW_TRAINER_IMAGE=ctj/kubeflow-trainer:<key>  deploy/kubeflow-trainer/Dockerfile,
#                                            Kubeflow Trainer v2's controller (TrainJob)
#
#   hack/containers/images.sh [operator|sidecar|trainer|seaweedfs|kubeflow|kueue|jobset|
#                              kubeflow-trainer ...]  (default: all)
#   hack/containers/images.sh --prune IMAGE...   remove every other build of these images
#                                                (older tags of ctj/operator, ctj/trainer, ...)
#
# <key> hashes every input of an image (the Dockerfile, the files it copies, the base
# image's ID), so an unchanged tree is a no-op and a changed one gets a new tag: pods
# never run a stale image under an old name. Each of the Dockerfile's targets is keyed by
# what it copies (a change to examples/ retags the trainer only). Every image's size is
# printed on stderr (docs/deploy.md records them). The Python base is ctj/python:3.11-bookworm,
# Debian's python3 on the debootstrap base (base-image.sh). Users with a registry build
# the same Dockerfile FROM python:3.11-slim (docs/deploy.md).
#
# Kubeflow's controller is pulled first where a registry answers: Kubeflow's own image of
# the pinned version ($KUBEFLOW_TRAINING_OPERATOR_IMAGE in hack/versions.env), printed
# under that name (hack/registry/pull.sh: CTJ_PULL, CTJ_REGISTRY_MIRROR; docs/registry.md).
# SeaweedFS is pinned to a commit of its master, which has no published image: built here.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# shellcheck disable=SC1091
source "$root/hack/versions.env"
# shellcheck disable=SC1091  # hack/registry/pull.sh: pull-or-build
source "$root/hack/registry/pull.sh"
DOCKER=/usr/bin/docker
export DOCKER_BUILDKIT=1
log() { printf 'images: %s\n' "$*" >&2; }

# key INPUTS...: a short hash of files' contents (and of any literal strings given)
key() {
  local f
  for f in "$@"; do
    if [ -d "$f" ]; then
      find "$f" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' \
        -print0 | sort -z | xargs -0 sha256sum
    elif [ -f "$f" ]; then sha256sum "$f"
    else printf '%s\n' "$f"; fi
  done | sed "s#$root/##" | sha256sum | cut -c1-12
}

# build IMAGE DOCKERFILE CONTEXT [docker build args...]: build unless IMAGE exists
# (NOT_PULLED in the environment: why a published image was not pulled instead)
build() {
  local image="$1" file="$2" context="$3"; shift 3
  if "$DOCKER" image inspect "$image" >/dev/null 2>&1; then return 0; fi
  local start blog; start=$(date +%s)
  blog="${CTJ_CACHE:-$HOME/.cache/ctj}/build-${image//[\/:]/-}.log"
  log "building $image${NOT_PULLED:+ (not pulled: $NOT_PULLED)} (progress: $blog)"
  if ! "$DOCKER" build --progress=plain -f "$file" -t "$image" "$@" "$context" >"$blog" 2>&1; then
    tail -n 30 "$blog" >&2
    log "building $image failed"; return 1
  fi
  log "built $image in $(( $(date +%s) - start ))s ($(size "$image"))"
}

# size IMAGE: as `docker image ls` shows it (MB = 10^6 bytes)
size() {
  "$DOCKER" image inspect -f '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1/1e6}'
}

if [ "${1:-}" = "--prune" ]; then
  # every code change makes new tags; the old ones would pile up (a new dependency pin
  # leaves a whole old trainer image behind: ~6 GB)
  shift
  keep=" $* "
  for img in $("$DOCKER" images --format '{{.Repository}}:{{.Tag}}' \
               | grep -E '^ctj/(operator|sidecar|trainer|seaweedfs|training-operator|kueue|jobset|kubeflow-trainer):' || true); do
    if [[ "$keep" != *" $img "* ]] && "$DOCKER" rmi "$img" >/dev/null 2>&1; then
      log "removed $img (an older build)"
    fi
  done
  exit 0
fi

mkdir -p "${CTJ_CACHE:-$HOME/.cache/ctj}"
base="$("$here/base-image.sh")"
base_id="$("$DOCKER" image inspect -f '{{.Id}}' "$base")"
python="ctj/python:3.11-bookworm-$(key "$here/python.Dockerfile" "$base_id")"
build "$python" "$here/python.Dockerfile" "$here" --build-arg "BASE=$base"

# binary_image NAME DOCKERFILE BINARY: an image of one Go binary (built by
# hack/cluster-binaries.sh) on the base image; the context is the Dockerfile and the binary
binary_image() {
  local name="$1" file="$2" binary="$3" image ctx
  image="ctj/$name:$(key "$file" "$binary" "$base_id")"
  if ! "$DOCKER" image inspect "$image" >/dev/null 2>&1; then
    ctx="$(mktemp -d)"; cp "$file" "$binary" "$ctx/"
    build "$image" "$ctx/Dockerfile" "$ctx" --build-arg "BASE=$base"; rm -rf "$ctx"
  fi
  echo "$image"
}
built_dir() { "$root/hack/cluster-binaries.sh" | sed -n "s/^$1=//p"; }

wanted=("$@"); (( ${#wanted[@]} )) || wanted=(operator sidecar trainer seaweedfs kubeflow kueue jobset kubeflow-trainer)
# ctj_inputs TARGET: what the Dockerfile's target is built from (its COPY sources), a line each
ctj_inputs() {
  printf '%s\n' "$root/Dockerfile" "$root/.dockerignore" "$root/requirements/dev.txt" \
    "$root/contract/ctj_contract" "$python"
  case "$1" in
    operator) printf '%s\n' "$root/operator/ctj_operator" ;;
    sidecar) printf '%s\n' "$root/trainer_sidecar" ;;
    trainer) printf '%s\n' "$root/trainer_sidecar" "$root/examples" ;;
  esac
}
for what in "${wanted[@]}"; do
  case "$what" in
    operator|sidecar|trainer)
      mapfile -t inputs < <(ctj_inputs "$what")
      image="ctj/$what:$(key "${inputs[@]}")"
      build "$image" "$root/Dockerfile" "$root" --target "$what" --build-arg "PYTHON_IMAGE=$python"
      log "$image: $(size "$image")"
      echo "CTJ_${what^^}_IMAGE=$image" ;;
    seaweedfs)
      image="$(binary_image seaweedfs "$root/deploy/seaweedfs/Dockerfile" \
        "$(built_dir CTJ_SEAWEEDFS_BIN_DIR)/weed")"
      log "$image: $(size "$image")"
      echo "CTJ_SEAWEEDFS_IMAGE=$image" ;;
    kubeflow)
      # pulled before anything is built: the binary is needed only for a build
      if pull_image "$KUBEFLOW_TRAINING_OPERATOR_IMAGE"; then
        image="$KUBEFLOW_TRAINING_OPERATOR_IMAGE"
      else
        image="$(NOT_PULLED="$PULL_WHY" binary_image training-operator \
          "$root/deploy/kubeflow/Dockerfile" "$(built_dir CTJ_KUBEFLOW_BIN_DIR)/training-operator.v1")"
      fi
      log "$image: $(size "$image")"
      echo "CTJ_KUBEFLOW_IMAGE=$image" ;;
    kueue)
      image="$(binary_image kueue "$root/deploy/kueue/Dockerfile" \
        "$(built_dir CTJ_KUEUE_BIN_DIR)/kueue")"
      log "$image: $(size "$image")"
      echo "CTJ_KUEUE_IMAGE=$image" ;;
    jobset)
      image="$(binary_image jobset "$root/deploy/jobset/Dockerfile" \
        "$(built_dir CTJ_JOBSET_BIN_DIR)/jobset")"
      log "$image: $(size "$image")"
      echo "CTJ_JOBSET_IMAGE=$image" ;;
    kubeflow-trainer)
      image="$(binary_image kubeflow-trainer "$root/deploy/kubeflow-trainer/Dockerfile" \
        "$(built_dir CTJ_KUBEFLOW_TRAINER_BIN_DIR)/trainer-controller-manager")"
      log "$image: $(size "$image")"
      echo "CTJ_KUBEFLOW_TRAINER_IMAGE=$image" ;;
    *) log "unknown image '$what' (operator, sidecar, trainer, seaweedfs, kubeflow, kueue, jobset, kubeflow-trainer)"
       exit 2 ;;
  esac
done
