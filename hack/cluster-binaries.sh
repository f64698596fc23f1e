#!/usr/bin/env bash
# Builds (once) the local control plane's binaries from Go modules and prints where they are.
#
#   hack/cluster-binaries.sh           build what is missing, print the paths (KEY=PATH lines)
#   hack/cluster-binaries.sh --check   build nothing; print the paths, exit 3 if any is missing
#   hack/cluster-binaries.sh --local   build only what the unit and integration tiers run
#                                      (helm, SeaweedFS); print every path as --check does,
#                                      exit 0 (the test command runs those tiers while the
#                                      rest builds)
#   hack/cluster-binaries.sh --kind    (opt-in; hack/kind uses it) build and print what the kind
#                                      cluster's images are made of: the above's etcd and control
#                                      plane, plus kind, kubelet/kubeadm/kube-proxy/kubectl (module
#                                      gomod/k8s-node), CoreDNS, crictl, hack/kind/go's pause
#                                      and route agent, and kube-network-policies (the
#                                      cluster's NetworkPolicy enforcer, hack/kind/network-policies)
#   hack/cluster-binaries.sh --kind-check   the same paths, building nothing (exit 3 if missing)
#
# Why from source: these machines have no Docker and cannot reach GitHub or dl.k8s.io, only
# the Go module proxy. The wrapper modules in hack/gomod/ (see regen.sh there) pin
# k8s.io/kubernetes, etcd, helm, Kubeflow's training-operator, Kueue, JobSet, Kubeflow Trainer v2
# and SeaweedFS (the tests' and benchmarks' real S3 server); every binary is built from them with
# the local Go. The training-operator's directory also gets its PyTorchJob CRD and
# ClusterRole (crds/, rbac/), copied from the same module version.
#
# Cache: ${CTJ_CACHE:-~/.cache/ctj}/<name>-<version>-<recipe>/bin, where <recipe> hashes the
# wrapper module and the build flags, so a changed recipe builds into a new directory. A
# directory counts only once its .complete marker exists (written last), so an interrupted
# build is simply redone. GOCACHE and GOMODCACHE live under the cache too, so CI can keep
# them and a rebuild after a flag change recompiles little.
#
# Downloaded where published: etcd, the control plane, helm, and for --kind kind, kubelet/
# kubeadm/kube-proxy/kubectl and crictl are fetched pre-built at the same versions from
# dl.k8s.io, GitHub releases and get.helm.sh where those answer (hack/registry/download.sh:
# each file checked against its published sha256; CTJ_DOWNLOAD=auto|never|always, default
# $CTJ_PULL; CTJ_DOWNLOAD_MIRROR, CTJ_DL_*; docs/registry.md). They go into
# <name>-<version>-dl/bin (no build recipe made them); where nothing answers (a DNS failure
# or a 3 s probe, once per site) they are built as above. A complete directory of either
# kind is used as it is, the built one first, so a warm cache neither downloads nor builds.
set -euo pipefail
hack="$(cd "$(dirname "$0")" && pwd)"
# shellcheck disable=SC1091
source "$hack/versions.env"
# shellcheck source=hack/registry/download.sh
source "$hack/registry/download.sh"
mode="${1:-build}"
cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
export PATH="${CTJ_GO_ROOT:-/usr/local/go}/bin:$PATH"
export GOTOOLCHAIN=local GOSUMDB=off GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
export GOCACHE="$cache/go/build" GOMODCACHE="$cache/go/mod"
# One build at a time per cache: the test command, the demo and the e2e preparation may
# each call this script, and two builds of one recipe would share its .tmp directory.
# A caller that waited finds the other's .complete and builds nothing. The checks build
# nothing and never wait (the tests run them while the e2e tier's build goes on).
case "$mode" in
  --check|--kind-check) ;;
  *) mkdir -p "$cache"; exec 8>"$cache/.cluster-binaries.lock"; flock 8 ;;
esac

log() { printf 'cluster-binaries: %s\n' "$*" >&2; }

# recipe_dir NAME VERSION MODULE_DIR FLAGS... -> the cache directory for that exact recipe
recipe_dir() {
  local name="$1" version="$2" module="$3"; shift 3
  local h
  h="$( { cat "$module"/go.mod "$module"/go.sum "$module"/*.go; printf '%s\n' "$@" "$(go env GOVERSION)"; } \
        | sha256sum | cut -c1-10)"
  printf '%s/%s-%s-%s' "$cache" "$name" "$version" "$h"
}

# build NAME DIR MODULE LDFLAGS PACKAGES... : one `go build` for all packages (shared compiles)
build() {
  local name="$1" dir="$2" module="$3" ldflags="$4"; shift 4
  local start total n=0 line
  start=$(date +%s)
  log "[$name] downloading modules into $GOMODCACHE"
  (cd "$module" && go mod download)
  total=$(cd "$module" && go list -deps "$@" | grep -c .)
  log "[$name] compiling up to $total packages into $dir (cached ones are skipped)"
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/bin"
  # -v names each package as it is compiled: turn that into progress, pass errors through.
  (cd "$module" && nice -n "${CTJ_BUILD_NICE:-10}" go build -v -trimpath -ldflags "$ldflags" \
      -o "$dir.tmp/bin/" "$@" 2>&1) | while IFS= read -r line; do
    if [[ "$line" =~ ^[A-Za-z0-9._~/-]+$ ]]; then
      n=$((n + 1))
      if (( n % 100 == 0 )); then log "[$name] $n/$total packages ($(( $(date +%s) - start ))s)"; fi
    else
      printf '%s\n' "$line" >&2
    fi
  done
  local rc=${PIPESTATUS[0]}
  if (( rc != 0 )); then log "[$name] go build failed (exit $rc)"; return "$rc"; fi
  if declare -F "extras_$name" >/dev/null; then "extras_$name" "$dir.tmp"; fi
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
  date -u +%FT%TZ > "$dir/.complete"
  log "[$name] built in $(( $(date +%s) - start ))s"
}

# dl_dir NAME VERSION -> where NAME's published binaries are downloaded to
dl_dir() { printf '%s/%s-%s-dl' "$cache" "$1" "$2"; }
# download_or_build VAR NAME VERSION MODULE LDFLAGS PACKAGES...: NAME's published binaries
# into dl_dir (VAR is then set to it), else `build NAME "${!VAR}" ...` as before
download_or_build() {
  local var="$1" name="$2" version="$3" dl; shift 3
  dl="$(dl_dir "$name" "$version")"
  if download_tool "$name" "$version" "$dl"; then printf -v "$var" '%s' "$dl"; return 0; fi
  build "$name" "${!var}" "$@"
}
# extras_dl_kind DIR: hack/kind/images.sh copies kind's node-image files from its module,
# which a downloaded kind did not bring into GOMODCACHE
extras_dl_kind() {
  log "[kind] downloading the module sigs.k8s.io/kind@$KIND_VERSION (its node-image files)"
  (cd "$hack/gomod/kind" && go mod download sigs.k8s.io/kind)
}

kubeflow_pkg=github.com/kubeflow/training-operator
kueue_pkg=sigs.k8s.io/kueue
# extras_kueue DIR: Kueue's CRDs and its manager's ClusterRole, and its whole install
# (config/default, rendered by the control plane's kubectl: what a release's manifests.yaml
# is), from the module built
extras_kueue() {
  local src
  src="$(cd "$hack/gomod/kueue" && go list -m -f '{{.Dir}}' "$kueue_pkg")/config"
  mkdir -p "$1/crds" "$1/rbac"
  cp "$src"/components/crd/bases/*.yaml "$1/crds/"
  cp "$src/components/rbac/role.yaml" "$1/rbac/"
  "$k8s_dir/bin/kubectl" kustomize "$src/default" > "$1/manifests.yaml"
}
jobset_pkg=sigs.k8s.io/jobset
trainer_pkg=github.com/kubeflow/trainer/v2
# extras_jobset DIR: JobSet's whole install (config/default rendered: its release's
# manifests.yaml; CRD, manager, RBAC, webhooks, its internal certificate rotation)
extras_jobset() {
  local src
  src="$(cd "$hack/gomod/jobset" && go list -m -f '{{.Dir}}' "$jobset_pkg")/config"
  "$k8s_dir/bin/kubectl" kustomize "$src/default" > "$1/manifests.yaml"
}
# extras_kubeflow-trainer DIR: Trainer's install as its manifests/overlays/manager makes it
# (CRDs, manager, RBAC, webhooks; no runtimes), less the JobSet it pulls from GitHub (the
# line its own comment says to drop where JobSet is installed: ours is built above). The
# overlay is rendered from a copy, the module cache being read-only.
extras_kubeflow-trainer() {
  local src tmp
  src="$(cd "$hack/gomod/trainer" && go list -m -f '{{.Dir}}' "$trainer_pkg")/manifests"
  tmp="$1/.manifests-src"
  rm -rf "$tmp" && cp -r "$src" "$tmp" && chmod -R u+w "$tmp"
  sed -i '\#third-party/jobset#d' "$tmp/overlays/manager/kustomization.yaml"
  "$k8s_dir/bin/kubectl" kustomize "$tmp/overlays/manager" > "$1/manifests.yaml"
  rm -rf "$tmp"
}
# extras_kube-network-policies DIR: its main package is .../cmd, which `go build -o DIR/`
# names `cmd`
extras_kube-network-policies() { mv "$1/bin/cmd" "$1/bin/kube-network-policies"; }
# extras_NAME DIR: files besides the binaries, put in place before the .complete marker.
# The training-operator's PyTorchJob CRD and ClusterRole, from the very module it is built from.
extras_kubeflow() {
  local src
  src="$(cd "$hack/gomod/kubeflow" && go list -m -f '{{.Dir}}' "$kubeflow_pkg")/manifests/base"
  mkdir -p "$1/crds" "$1/rbac"
  cp "$src/crds/kubeflow.org_pytorchjobs.yaml" "$1/crds/"
  cp "$src/rbac/role.yaml" "$1/rbac/"
}

k8s_minor="${K8S_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean"
done
helm_minor="$(sed -n 's#^\s*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$hack/gomod/helm/go.mod")"
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$helm_minor"
done
etcd_ldflags="-s -w"
k8s_dir="$(recipe_dir k8s "$K8S_VERSION" "$hack/gomod/k8s" "$k8s_ldflags")"
etcd_dir="$(recipe_dir etcd "$ETCD_VERSION" "$hack/gomod/etcd" "$etcd_ldflags")"
helm_dir="$(recipe_dir helm "$HELM_VERSION" "$hack/gomod/helm" "$helm_ldflags")"
kubeflow_ldflags="-s -w"
kubeflow_dir="$(recipe_dir kubeflow "$KUBEFLOW_TRAINING_OPERATOR_VERSION" "$hack/gomod/kubeflow" \
  "$kubeflow_ldflags")"
kueue_ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
kueue_dir="$(recipe_dir kueue "$KUEUE_VERSION" "$hack/gomod/kueue" "$kueue_ldflags" \
  "extras: crds rbac manifests.yaml")"
jobset_ldflags="-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion=$JOBSET_VERSION"
jobset_dir="$(recipe_dir jobset "$JOBSET_VERSION" "$hack/gomod/jobset" "$jobset_ldflags" \
  "extras: manifests.yaml")"
# (the trainer's manager has no version variable to set)
trainer_ldflags="-s -w"
trainer_dir="$(recipe_dir kubeflow-trainer "$KUBEFLOW_TRAINER_VERSION" "$hack/gomod/trainer" \
  "$trainer_ldflags" "extras: manifests.yaml (overlays/manager less third-party/jobset)")"
seaweedfs_ldflags="-s -w"
seaweedfs_dir="$(recipe_dir seaweedfs "$SEAWEEDFS_VERSION" "$hack/gomod/seaweedfs" "$seaweedfs_ldflags")"
# a complete downloaded directory stands for the built one (hack/registry/download.sh)
k8s_dir="$(download_pick "$k8s_dir" "$(dl_dir k8s "$K8S_VERSION")")"
etcd_dir="$(download_pick "$etcd_dir" "$(dl_dir etcd "$ETCD_VERSION")")"
helm_dir="$(download_pick "$helm_dir" "$(dl_dir helm "$HELM_VERSION")")"

# etcd and the control plane's binaries: both modes need them (kind's images carry them)
build_control_plane() {
  if [ ! -f "$etcd_dir/.complete" ]; then
    download_or_build etcd_dir etcd "$ETCD_VERSION" "$hack/gomod/etcd" "$etcd_ldflags" .
  fi
  if [ ! -f "$k8s_dir/.complete" ]; then
    download_or_build k8s_dir k8s "$K8S_VERSION" "$hack/gomod/k8s" "$k8s_ldflags" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
  fi
}

print_paths() {
  echo "CTJ_ETCD_BIN_DIR=$etcd_dir/bin"
  echo "CTJ_K8S_BIN_DIR=$k8s_dir/bin"
  echo "CTJ_HELM_BIN_DIR=$helm_dir/bin"
  echo "CTJ_KUBEFLOW_BIN_DIR=$kubeflow_dir/bin"
  echo "CTJ_KUEUE_BIN_DIR=$kueue_dir/bin"
  echo "CTJ_JOBSET_BIN_DIR=$jobset_dir/bin"
  echo "CTJ_KUBEFLOW_TRAINER_BIN_DIR=$trainer_dir/bin"
  echo "CTJ_SEAWEEDFS_BIN_DIR=$seaweedfs_dir/bin"
}

# ---- --kind / --kind-check: what hack/kind's images are made of (opt-in) -----------
if [ "$mode" = "--kind" ] || [ "$mode" = "--kind-check" ]; then
  kind_ldflags="-s -w"
  kind_dir="$(recipe_dir kind "$KIND_VERSION" "$hack/gomod/kind" "$kind_ldflags")"
  k8s_node_dir="$(recipe_dir k8s-node "$K8S_VERSION" "$hack/gomod/k8s-node" "$k8s_ldflags")"
  coredns_ldflags="-s -w -X github.com/coredns/coredns/coremain.GitCommit=ctj-$COREDNS_VERSION"
  coredns_dir="$(recipe_dir coredns "$COREDNS_VERSION" "$hack/gomod/coredns" "$coredns_ldflags")"
  crictl_ldflags="-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRI_TOOLS_VERSION"
  crictl_dir="$(recipe_dir crictl "$CRI_TOOLS_VERSION" "$hack/gomod/cri-tools" "$crictl_ldflags")"
  # kube-network-policies: its module in hack/kind/network-policies, built with one file
  # of google/nftables replaced (_overlay/nftables-queue.go says why)
  knp_src="$hack/kind/network-policies"
  knp_overlay_src="$knp_src/_overlay/nftables-queue.go"
  knp_ldflags="-s -w"
  knp_dir="$(recipe_dir kube-network-policies "$KUBE_NETWORK_POLICIES_VERSION" "$knp_src" \
    "$knp_ldflags" "$(sha256sum < "$knp_overlay_src")")"
  grep -q "^require sigs.k8s.io/kube-network-policies $KUBE_NETWORK_POLICIES_VERSION\$" "$knp_src/go.mod" \
    || { log "$knp_src/go.mod does not require kube-network-policies $KUBE_NETWORK_POLICIES_VERSION (hack/versions.env): regenerate it (its header says how)"; exit 1; }
  kind_dir="$(download_pick "$kind_dir" "$(dl_dir kind "$KIND_VERSION")")"
  k8s_node_dir="$(download_pick "$k8s_node_dir" "$(dl_dir k8s-node "$K8S_VERSION")")"
  crictl_dir="$(download_pick "$crictl_dir" "$(dl_dir crictl "$CRI_TOOLS_VERSION")")"
  # hack/kind/go has no go.sum (standard library only) and its sources sit in cmd/*:
  # its recipe is the hash of every file in it.
  kind_tools_src="$hack/kind/go"
  kind_tools_hash="$(cd "$kind_tools_src" && find . -type f | LC_ALL=C sort | xargs sha256sum \
    | { cat; go env GOVERSION; } | sha256sum | cut -c1-10)"
  kind_tools_dir="$cache/kind-tools-$kind_tools_hash"
  kind_paths() {
    echo "CTJ_ETCD_BIN_DIR=$etcd_dir/bin"
    echo "CTJ_K8S_BIN_DIR=$k8s_dir/bin"
    echo "CTJ_KIND_BIN_DIR=$kind_dir/bin"
    echo "CTJ_K8S_NODE_BIN_DIR=$k8s_node_dir/bin"
    echo "CTJ_COREDNS_BIN_DIR=$coredns_dir/bin"
    echo "CTJ_CRICTL_BIN_DIR=$crictl_dir/bin"
    echo "CTJ_KIND_TOOLS_BIN_DIR=$kind_tools_dir/bin"
    echo "CTJ_KUBE_NETWORK_POLICIES_BIN_DIR=$knp_dir/bin"
  }
  kmissing=()
  for d in "$etcd_dir" "$k8s_dir" "$kind_dir" "$k8s_node_dir" "$coredns_dir" "$crictl_dir" \
           "$kind_tools_dir" "$knp_dir"; do
    [ -f "$d/.complete" ] || kmissing+=("$d")
  done
  if [ "$mode" = "--kind-check" ]; then
    kind_paths
    if (( ${#kmissing[@]} )); then log "not built: ${kmissing[*]}"; exit 3; fi
    exit 0
  fi
  t0=$(date +%s)
  build_control_plane
  if [ ! -f "$kind_tools_dir/.complete" ]; then
    build kind-tools "$kind_tools_dir" "$kind_tools_src" "-s -w" ./cmd/pause ./cmd/ctj-kind-routes
  fi
  if [ ! -f "$kind_dir/.complete" ]; then
    download_or_build kind_dir kind "$KIND_VERSION" "$hack/gomod/kind" "$kind_ldflags" \
      sigs.k8s.io/kind
  fi
  if [ ! -f "$crictl_dir/.complete" ]; then
    download_or_build crictl_dir crictl "$CRI_TOOLS_VERSION" "$hack/gomod/cri-tools" \
      "$crictl_ldflags" sigs.k8s.io/cri-tools/cmd/crictl
  fi
  if [ ! -f "$coredns_dir/.complete" ]; then
    build coredns "$coredns_dir" "$hack/gomod/coredns" "$coredns_ldflags" .
  fi
  if [ ! -f "$k8s_node_dir/.complete" ]; then
    download_or_build k8s_node_dir k8s-node "$K8S_VERSION" "$hack/gomod/k8s-node" "$k8s_ldflags" \
      k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubeadm \
      k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl
  fi
  if [ ! -f "$knp_dir/.complete" ]; then
    # Go takes no -overlay of a file in the module cache: the build runs in a copy of our
    # module whose go.mod replaces google/nftables by a copy of it with that one file ours
    knp_build="$cache/go/src/kube-network-policies-${knp_dir##*-}"
    knp_nftables="$(cd "$knp_src" && go mod download github.com/google/nftables \
      && go list -m -f '{{.Dir}}' github.com/google/nftables)"
    rm -rf "$knp_build" && mkdir -p "$knp_build"
    cp "$knp_src"/go.mod "$knp_src"/go.sum "$knp_src"/tools.go "$knp_build/"
    cp -r "$knp_nftables" "$knp_build/nftables" && chmod -R u+w "$knp_build/nftables"
    cp "$knp_overlay_src" "$knp_build/nftables/expr/queue.go"
    printf '\nreplace github.com/google/nftables => ./nftables\n' >> "$knp_build/go.mod"
    build kube-network-policies "$knp_dir" "$knp_build" "$knp_ldflags" \
      sigs.k8s.io/kube-network-policies/cmd
    rm -rf "$knp_build"
  fi
  if (( ${#kmissing[@]} )); then
    log "cold start (download or build) of ${kmissing[*]##*/} took $(( $(date +%s) - t0 ))s"
  else
    log "all kind binaries cached"
  fi
  kind_paths
  exit 0
fi

missing=()
for d in "$etcd_dir" "$k8s_dir" "$helm_dir" "$kubeflow_dir" "$kueue_dir" "$jobset_dir" \
         "$trainer_dir" "$seaweedfs_dir"; do
  [ -f "$d/.complete" ] || missing+=("$d")
done
if [ "$mode" = "--check" ]; then
  print_paths
  if (( ${#missing[@]} )); then log "not built: ${missing[*]}"; exit 3; fi
  exit 0
fi
if [ "$mode" != "build" ] && [ "$mode" != "--local" ]; then
  log "usage: $0 [--check|--local|--kind|--kind-check]"; exit 2
fi

# helm (the chart's tests render it) and SeaweedFS (the S3 server of every tier): all the
# tiers before the cluster tier need, so --local builds them first
build_local() {
  if [ ! -f "$helm_dir/.complete" ]; then
    download_or_build helm_dir helm "$HELM_VERSION" "$hack/gomod/helm" "$helm_ldflags" \
      helm.sh/helm/v3/cmd/helm
  fi
  if [ ! -f "$seaweedfs_dir/.complete" ]; then
    build seaweedfs "$seaweedfs_dir" "$hack/gomod/seaweedfs" "$seaweedfs_ldflags" \
      github.com/seaweedfs/seaweedfs/weed
  fi
}

t0=$(date +%s)
build_local
if [ "$mode" = "--local" ]; then
  log "helm and SeaweedFS ready in $(( $(date +%s) - t0 ))s"
  print_paths
  exit 0
fi
build_control_plane
if [ ! -f "$kubeflow_dir/.complete" ]; then
  build kubeflow "$kubeflow_dir" "$hack/gomod/kubeflow" "$kubeflow_ldflags" \
    "$kubeflow_pkg/cmd/training-operator.v1"
fi
if [ ! -f "$kueue_dir/.complete" ]; then
  build kueue "$kueue_dir" "$hack/gomod/kueue" "$kueue_ldflags" "$kueue_pkg/cmd/kueue"
fi
if [ ! -f "$jobset_dir/.complete" ]; then
  # its manager is the module root's main package: `go build -o DIR/` names it `jobset`
  build jobset "$jobset_dir" "$hack/gomod/jobset" "$jobset_ldflags" "$jobset_pkg"
fi
if [ ! -f "$trainer_dir/.complete" ]; then
  build kubeflow-trainer "$trainer_dir" "$hack/gomod/trainer" "$trainer_ldflags" \
    "$trainer_pkg/cmd/trainer-controller-manager"
fi
if (( ${#missing[@]} )); then
  log "cold start (download or build) of ${missing[*]##*/} took $(( $(date +%s) - t0 ))s"
else
  log "all binaries cached"
fi
print_paths
