#!/usr/bin/env bash
# The CNCF distribution registry (the `registry` of Docker Hub's registry:3 image), built
# from the Go module proxy, for testing the pull path (hack/registry/pull.sh) on a machine
# that reaches no registry: a registry on loopback stands in for registry.k8s.io, docker.io
# or a corporate mirror.
#
#   hack/registry/registry.sh build            build once; print the binary's path
#   hack/registry/registry.sh run PORT DIR     serve on 127.0.0.1:PORT, blobs under DIR
#                                              (foreground; the caller stops it)
#
# Cache: ${CTJ_CACHE:-~/.cache/ctj}/registry-<version>/bin/registry with a .complete marker
# written last (hack/cluster-binaries.sh's layout), so an interrupted build is redone.
set -euo pipefail
hack="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck disable=SC1091
source "$hack/versions.env"
cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
dir="$cache/registry-$DISTRIBUTION_VERSION"
log() { printf 'registry: %s\n' "$*" >&2; }

build() {
  if [ -f "$dir/.complete" ]; then echo "$dir/bin/registry"; return 0; fi
  # one build at a time (two would share $dir.tmp); released when this (sub)shell ends
  mkdir -p "$cache"
  exec 9>"$cache/.registry-build.lock"
  flock 9
  if [ -f "$dir/.complete" ]; then echo "$dir/bin/registry"; return 0; fi
  export PATH="${CTJ_GO_ROOT:-/usr/local/go}/bin:$PATH"
  # the same module and build caches as cluster-binaries.sh; no checksum database is
  # reachable here (the proxy is), as there
  export GOTOOLCHAIN=local GOSUMDB=off GOFLAGS=-buildvcs=false CGO_ENABLED=0
  export GOCACHE="$cache/go/build" GOMODCACHE="$cache/go/mod"
  local start; start=$(date +%s)
  log "building github.com/distribution/distribution/v3 $DISTRIBUTION_VERSION into $dir"
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/bin"
  GOBIN="$dir.tmp/bin" nice -n "${CTJ_BUILD_NICE:-10}" go install -trimpath -ldflags "-s -w" \
    "github.com/distribution/distribution/v3/cmd/registry@$DISTRIBUTION_VERSION"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
  date -u +%FT%TZ > "$dir/.complete"
  log "built in $(( $(date +%s) - start ))s"
  echo "$dir/bin/registry"
}

# run PORT DIR: loopback only, deletes allowed (tests remove what they pushed), no
# tracing exporter (it would try to reach a collector on localhost:4318), a fixed upload
# secret (it signs upload state; generated, it only adds a warning to the log)
run() {
  local port="$1" root="$2" bin config
  bin="$(build)"
  mkdir -p "$root"
  config="$root/config.yml"
  cat > "$config" <<YAML
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage:
  filesystem: {rootdirectory: $root/data}
  delete: {enabled: true}
http:
  addr: 127.0.0.1:$port
  secret: ctj-loopback-test
YAML
  OTEL_TRACES_EXPORTER=none exec "$bin" serve "$config"
}

case "${1:-}" in
  build) build ;;
  run) [ $# -eq 3 ] || { log "usage: $0 run PORT DIR"; exit 2; }; run "$2" "$3" ;;
  *) log "usage: $0 build | run PORT DIR"; exit 2 ;;
esac
