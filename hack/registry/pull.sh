# shellcheck shell=bash
# Pull-or-build for images that have a standard published name at the version we pin
# (registry.k8s.io's Kubernetes components, etcd, CoreDNS, pause; Kubeflow's controller).
# Sourced by hack/kind/images.sh and hack/containers/images.sh, which call
#
#   pull_image NAME...    0: every NAME is now in Docker under that very name, pulled
#                         (now or by an earlier run); 1: build them as before, $PULL_WHY
#                         says why not (for the caller's "building ..." line)
#   pull_present NAME...  0 if every NAME is in Docker from an earlier pull (no network)
#
# NAMEs are fully qualified (registry.k8s.io/pause:3.10, docker.io/kubeflow/...). Settings:
#   CTJ_PULL=auto      (default) pull where the registry answers, else build
#            never     build here, as on a machine with no registry
#            always    pull, and fail (exit 1) rather than build
#   CTJ_REGISTRY_MIRROR=HOST[:PORT][/PATH]   pull every NAME as HOST[:PORT][/PATH]/NAME
#                      (a mirror that proxies several registries under their names);
#                      or REGISTRY=PREFIX words, e.g. "registry.k8s.io=mirror.corp/k8s
#                      docker.io=mirror.corp/hub", each replacing that registry's host
#                      (registries not named are pulled directly)
#   CTJ_PULL_PROBE_TIMEOUT   seconds the reachability probe waits (default 3)
#   CTJ_PULL_TIMEOUT         seconds one `docker pull` may take (default 600)
#
# Each registry is probed once per process (curl of its /v2/ endpoint: any HTTP answer,
# 401 included, means it is there), so with no network the default path costs a DNS
# failure or CTJ_PULL_PROBE_TIMEOUT, never a hang. An image we built carries a label
# ctj.inputs; a NAME present without it came from a registry and is kept (unless
# CTJ_PULL=never: then it is rebuilt, as on a machine that never pulled).

# shellcheck source=hack/registry/probe.sh
source "$(dirname "${BASH_SOURCE[0]}")/probe.sh"
PULL_WHY=""
declare -gA _pull_probed=()   # host -> "yes", or why not

pull_log() { printf 'pull: %s\n' "$*" >&2; }
# Debian's CLI, as the image scripts use (a newer docker CLI may be first on PATH)
_pull_docker() { "${DOCKER:-/usr/bin/docker}" "$@"; }

# pull_source NAME: the reference NAME is pulled as, given CTJ_REGISTRY_MIRROR
pull_source() {
  local name="$1" registry="${1%%/*}" word
  for word in ${CTJ_REGISTRY_MIRROR:-}; do
    case "$word" in
      "$registry="*) echo "${word#*=}/${name#*/}"; return 0 ;;
      *=*) ;;                                  # a mapping for another registry
      *) echo "${word%/}/$name"; return 0 ;;  # one mirror for every registry
    esac
  done
  echo "$name"
}

# pull_reachable HOST: whether HOST's registry API answers (probed once; why not in PULL_WHY)
pull_reachable() {
  local host="$1" api="$1" scheme why t="${CTJ_PULL_PROBE_TIMEOUT:-3}"
  if [ -z "${_pull_probed[$host]:-}" ]; then
    [ "$host" != docker.io ] || api="registry-1.docker.io"   # Docker Hub's API host
    # https first; plain http is what Docker uses for a registry on loopback
    for scheme in https http; do
      if why="$(http_probe "$api" "$scheme://$api/v2/" "$t")"; then why=yes; break; fi
    done
    _pull_probed[$host]="$why"   # yes, or why the last (http) try failed
  fi
  [ "${_pull_probed[$host]}" = yes ] && return 0
  PULL_WHY="${_pull_probed[$host]}"
  return 1
}

# _pull_is_pulled NAME: true if NAME is in Docker and was not built by us
_pull_is_pulled() {
  local label
  label="$(_pull_docker image inspect -f '{{index .Config.Labels "ctj.inputs"}}' "$1" 2>/dev/null)" \
    || return 1
  [ -z "$label" ]
}

# pull_present NAME...: every NAME pulled earlier (asks no registry; false if CTJ_PULL=never)
pull_present() {
  local name
  [ "${CTJ_PULL:-auto}" != never ] || return 1
  for name in "$@"; do _pull_is_pulled "$name" || return 1; done
}

# _pull_one NAME: docker pull its source, retag it as NAME, drop the mirror's name
_pull_one() {
  local name="$1" src host out old start
  src="$(pull_source "$name")"
  host="${src%%/*}"
  pull_reachable "$host" || return 1
  start=$(date +%s)
  old="$(_pull_docker image inspect -f '{{.Id}}' "$name" 2>/dev/null || true)"
  if ! out="$(timeout "${CTJ_PULL_TIMEOUT:-600}" "${DOCKER:-/usr/bin/docker}" pull -q "$src" 2>&1)"
  then
    PULL_WHY="docker pull $src: $(printf '%s' "$out" | tail -n 1)"
    return 1
  fi
  if [ "$src" != "$name" ]; then
    # (errexit is off in here: callers test this function's status)
    _pull_docker tag "$src" "$name" || { PULL_WHY="docker tag $src $name failed"; return 1; }
    _pull_docker rmi "$src" >/dev/null || true
  fi
  # the build this replaces, unless something still uses it (as images.sh does for builds)
  if [ -n "$old" ] && [ "$old" != "$(_pull_docker image inspect -f '{{.Id}}' "$name")" ]; then
    _pull_docker rmi "$old" >/dev/null 2>&1 || true
  fi
  pull_log "$name: pulled from $src ($(( $(date +%s) - start ))s)"
}

# pull_image NAME...: see the top; with CTJ_PULL=always a failure ends the calling script
pull_image() {
  local name
  PULL_WHY=""
  case "${CTJ_PULL:-auto}" in
    never) PULL_WHY="CTJ_PULL=never"; return 1 ;;
    auto|always) ;;
    *) pull_log "CTJ_PULL=${CTJ_PULL} is none of auto, never, always"; exit 2 ;;
  esac
  for name in "$@"; do
    _pull_is_pulled "$name" && continue
    if ! _pull_one "$name"; then
      if [ "${CTJ_PULL:-auto}" = always ]; then
        pull_log "CTJ_PULL=always and $name could not be pulled: $PULL_WHY"
        pull_log "(unset CTJ_PULL to build it here instead, or set CTJ_REGISTRY_MIRROR)"
        exit 1
      fi
      return 1
    fi
  done
}
