#!/usr/bin/env bash
# Builds (once) rancher's local-path-provisioner, kind's own default storage provisioner,
# from its Go module, and prints where it is:
#
#   hack/kind/local-path/build.sh           build it if missing; print CTJ_LOCAL_PATH_BIN_DIR=<dir>
#   hack/kind/local-path/build.sh --check   build nothing; the same line, exit 3 if missing
#
# Why: a StatefulSet's volume (the in-cluster SeaweedFS's, deploy/seaweedfs) must come back
# with its data when its pod is deleted. The controller-manager's host-path provisioner
# (kind's fallback) makes volumes with no node affinity, root-owned 0750 (a non-root server
# cannot write them). local-path-provisioner makes each volume a directory on the node the
# pod was first scheduled to and pins the PersistentVolume to that node, so a recreated pod
# goes back to its data. Upstream kind ships it from a registry; none answers here.
#
# Built in its own module directory (its go.mod and go.sum, -mod=readonly): exactly the
# dependency versions it was released with. Version: LOCAL_PATH_PROVISIONER_VERSION in hack/versions.env
# (the Go module proxy serves v0.0.30; kind v0.33.0 packages v0.0.34, which it does not).
# Cache: ${CTJ_CACHE:-~/.cache/ctj}/local-path-provisioner-<version>-<recipe>/bin, where
# <recipe> hashes the version, the flags and the Go version; .complete is written last.
set -euo pipefail
hack="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck disable=SC1091
source "$hack/versions.env"
mode="${1:-build}"
cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
export PATH="${CTJ_GO_ROOT:-/usr/local/go}/bin:$PATH"
export GOTOOLCHAIN=local GOSUMDB=off GOFLAGS="-buildvcs=false" CGO_ENABLED=0
export GOCACHE="$cache/go/build" GOMODCACHE="$cache/go/mod"
log() { printf 'local-path: %s\n' "$*" >&2; }

module=github.com/rancher/local-path-provisioner
version="$LOCAL_PATH_PROVISIONER_VERSION"
ldflags="-s -w -X main.VERSION=$version"
recipe="$(printf '%s\n' "$module@$version" "$ldflags" "$(go env GOVERSION)" | sha256sum | cut -c1-10)"
dir="$cache/local-path-provisioner-$version-$recipe"
if [ -f "$dir/.complete" ]; then echo "CTJ_LOCAL_PATH_BIN_DIR=$dir/bin"; exit 0; fi
if [ "$mode" = "--check" ]; then
  echo "CTJ_LOCAL_PATH_BIN_DIR=$dir/bin"; log "not built: $dir"; exit 3
fi
[ "$mode" = build ] || { log "usage: $0 [--check]"; exit 2; }
# one Go build at a time per cache, as hack/cluster-binaries.sh does (the same lock)
mkdir -p "$cache"
exec 8>"$cache/.cluster-binaries.lock"
flock 8
if [ -f "$dir/.complete" ]; then echo "CTJ_LOCAL_PATH_BIN_DIR=$dir/bin"; exit 0; fi
start=$(date +%s)
log "downloading $module@$version"
src="$(go mod download -json "$module@$version" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p')"
[ -f "$src/go.sum" ] || { log "$module@$version: no go.sum in $src"; exit 1; }
rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/bin"
log "compiling into $dir (its own go.mod and go.sum)"
(cd "$src" && nice -n "${CTJ_BUILD_NICE:-10}" go build -mod=readonly -trimpath -ldflags "$ldflags" \
  -o "$dir.tmp/bin/local-path-provisioner" .)
cp "$src/LICENSE" "$dir.tmp/"
rm -rf "$dir" && mv "$dir.tmp" "$dir"
date -u +%FT%TZ > "$dir/.complete"
log "built in $(( $(date +%s) - start ))s"
echo "CTJ_LOCAL_PATH_BIN_DIR=$dir/bin"
