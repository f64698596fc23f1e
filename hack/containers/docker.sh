#!/usr/bin/env bash
# Installs (once) and starts (if it is not running) a Docker daemon that can run kind's
# privileged nodes on these machines. Idempotent; needs root the first time.
#
#   hack/containers/docker.sh          install, start, wait until `docker info` answers
#   hack/containers/docker.sh --check  exit 0 if a daemon answers, 3 if none can (no start)
#
# What it works around (measured, ../shared/CONTAINERS.md): CAP_SYS_RESOURCE is missing from
# every process's bounding set, so runc cannot start a --privileged container; dockerd's
# default runtime is runc-nosysresource (beside this script), which drops that capability
# from the spec and execs runc. There is no systemd here: dockerd is started in the
# background, its log in ${CTJ_CACHE:-~/.cache/ctj}/dockerd.log.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
log() { printf 'containers: %s\n' "$*" >&2; }
# Debian's CLI: it speaks the 20.10 daemon's API and builds with BuildKit without buildx.
DOCKER=/usr/bin/docker

answers() { [ -x "$DOCKER" ] && timeout 10 "$DOCKER" info >/dev/null 2>&1; }

if [ "${1:-}" = "--check" ]; then answers && exit 0 || exit 3; fi
if answers; then exit 0; fi

need=()
for cmd in dockerd:docker.io containerd:containerd runc:runc debootstrap:debootstrap \
           iptables:iptables; do
  command -v "${cmd%%:*}" >/dev/null 2>&1 || need+=("${cmd##*:}")
done
[ -x /usr/bin/docker ] || need+=(docker.io)
if (( ${#need[@]} )); then
  log "installing ${need[*]} (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# the wrapper is run from the cache, not from this checkout: a daemon started from one
# clone keeps working after that clone is gone
mkdir -p "$cache/bin" /etc/docker
install -m 0755 "$here/runc-nosysresource" "$cache/bin/runc-nosysresource"
cat > /etc/docker/daemon.json <<JSON
{
  "storage-driver": "overlay2",
  "runtimes": {"ctj-runc": {"path": "$cache/bin/runc-nosysresource"}},
  "default-runtime": "ctj-runc"
}
JSON
if ! pgrep -x dockerd >/dev/null; then
  log "starting dockerd (log: $cache/dockerd.log)"
  # setsid: the daemon outlives the shell that started it, and never gets its signals
  setsid dockerd >>"$cache/dockerd.log" 2>&1 < /dev/null &
fi
for _ in $(seq 1 60); do
  if answers; then log "dockerd is up"; exit 0; fi
  sleep 1
done
log "dockerd did not answer within 60s; the end of its log:"
tail -n 20 "$cache/dockerd.log" >&2
exit 1
