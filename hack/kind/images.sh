#!/usr/bin/env bash
# Builds (once) every image the kind cluster runs, without a registry, and prints them.
#
#   hack/kind/images.sh           build what is missing; print IMAGE lines, then NODE_IMAGE=...
#   hack/kind/images.sh --check   build nothing; exit 3 if an image is missing or stale
#
# What from what (binaries from hack/cluster-binaries.sh --kind, bases from
# hack/containers/base-image.sh):
#   registry.k8s.io/kube-{apiserver,controller-manager,scheduler}:v1.34.4
#                                   ctj/debian:bookworm + the binary in /usr/local/bin
#   registry.k8s.io/etcd:3.6.16-0   ctj/debian:bookworm + etcd (kubeadm would default to
#                                   3.6.5-0: cluster.sh sets etcd.local.imageTag)
#   registry.k8s.io/kube-proxy:v1.34.4  ctj/kind-netbase (debian + iptables, conntrack, ipset)
#   ctj/kind-routes:<hash>          ctj/kind-netbase + hack/kind/go's route agent (the CNI)
#   ctj/kube-network-policies:v0.8.0-<hash>   ctj/kind-netbase + kube-network-policies (the
#                                   NetworkPolicy enforcer cluster.sh installs; built here
#                                   with one change, hack/kind/network-policies, so never
#                                   pulled under the upstream's name)
#   ctj/local-path-provisioner:v0.0.30-<hash>   ctj/debian:bookworm + rancher's
#                                   local-path-provisioner (hack/kind/local-path): kind's
#                                   default StorageClass (storage.yaml) and its helper pod
#   registry.k8s.io/coredns/coredns:v1.15.0   scratch + coredns (kubeadm's default would be
#                                   v1.12.1: cluster.sh sets dns.imageTag)
#   registry.k8s.io/pause:3.10, :3.10.1   scratch + hack/kind/go's pause (3.10 is kind's
#                                   containerd sandbox_image, 3.10.1 kubeadm's)
#   ctj/kind-node:v1.34.4-<hash>    hack/kind/node/Dockerfile
#
# Cached by inputs: every image carries a label ctj.inputs = hash of its Dockerfile, the
# cache directories of the binaries it holds (their names are version + recipe hashes) and
# its base image's ID; an image whose label matches is not rebuilt.
#
# Pulled where a registry answers: the registry.k8s.io images above are first pulled under
# their own names at the same versions (hack/registry/pull.sh: CTJ_PULL, CTJ_REGISTRY_MIRROR;
# docs/registry.md); one that cannot be is built as described. ctj/* images (the route
# agent, the node image with our CNI and containerd config) are always built here.
set -euo pipefail
kind_dir="$(cd "$(dirname "$0")" && pwd)"
hack="$(cd "$kind_dir/.." && pwd)"
# shellcheck disable=SC1091
source "$hack/versions.env"
# shellcheck disable=SC1091  # hack/registry/pull.sh: pull-or-build
source "$hack/registry/pull.sh"
mode="${1:-build}"
DOCKER=/usr/bin/docker
export DOCKER_BUILDKIT=1
log() { printf 'kind-images: %s\n' "$*" >&2; }
kind_mod="${CTJ_CACHE:-$HOME/.cache/ctj}/go/mod/sigs.k8s.io/kind@$KIND_VERSION"

etcd_tag="${ETCD_VERSION#v}-0"
coredns_tag="$COREDNS_VERSION"

if [ "$mode" = "--check" ]; then
  "$hack/containers/docker.sh" --check || { log "no Docker daemon"; exit 3; }
  paths="$("$hack/cluster-binaries.sh" --kind-check)" || exit 3
else
  "$hack/containers/docker.sh"
  # The base image belongs to hack/containers/base-image.sh: build it only when it is
  # missing, never "fix" one another checkout built from a different recipe.
  "$DOCKER" image inspect ctj/debian:bookworm >/dev/null 2>&1 \
    || "$hack/containers/base-image.sh" >/dev/null
  paths="$("$hack/cluster-binaries.sh" --kind)"
fi
eval "$paths"  # CTJ_*_BIN_DIR=... lines
base="ctj/debian:bookworm"
base_id="$("$DOCKER" image inspect -f '{{.Id}}' "$base" 2>/dev/null || echo none)"

work="$(mktemp -d "${TMPDIR:-/tmp}/ctj-kind-images.XXXXXX")"
trap 'rm -rf "$work"' EXIT
stale=()
built=0

id_of() { "$DOCKER" image inspect -f '{{.Id}}' "$1" 2>/dev/null || echo none; }

# image NAME DOCKERFILE_TEXT BASE_ID FILE... : a build context of FILEs (hardlinked when
# they can be) under bin/, built as NAME unless NAME's ctj.inputs label already matches.
# Extra tags: EXTRA_TAGS="a b" in the environment. PUBLISHED=1 in the environment: NAME (and
# the extra tags) are published names, pulled rather than built where they can be.
image() {
  local name="$1" dockerfile="$2" from_id="$3"; shift 3
  local key have ctx f start
  key="$(printf '%s\n' "$name" "$dockerfile" "$from_id" "$@" | sha256sum | cut -c1-16)"
  have="$("$DOCKER" image inspect -f '{{index .Config.Labels "ctj.inputs"}}' "$name" 2>/dev/null || true)"
  if [ "$have" = "$key" ]; then
    local t ok=1
    for t in ${EXTRA_TAGS:-}; do
      [ "$("$DOCKER" image inspect -f '{{index .Config.Labels "ctj.inputs"}}' "$t" 2>/dev/null)" = "$key" ] || ok=0
    done
    if (( ok )); then return 0; fi
  fi
  local not_pulled=""
  if [ -n "${PUBLISHED:-}" ]; then
    # shellcheck disable=SC2086  # EXTRA_TAGS is a list of words
    if [ "$mode" = "--check" ]; then pull_present "$name" ${EXTRA_TAGS:-} && return 0
    elif pull_image "$name" ${EXTRA_TAGS:-}; then return 0
    else not_pulled=" (not pulled: $PULL_WHY)"; fi
  fi
  if [ "$mode" = "--check" ]; then stale+=("$name"); return 0; fi
  start=$(date +%s)
  ctx="$work/$(echo "$name" | tr '/:' '__')"
  mkdir -p "$ctx/bin"
  for f in "$@"; do
    if [ -d "$f" ]; then cp -a "$f" "$ctx/"; else ln "$f" "$ctx/bin/" 2>/dev/null || cp "$f" "$ctx/bin/"; fi
  done
  printf '%s\nLABEL ctj.inputs=%s\n' "$dockerfile" "$key" > "$ctx/Dockerfile"
  local tags=(-t "$name") t
  for t in ${EXTRA_TAGS:-}; do tags+=(-t "$t"); done
  local old
  old="$("$DOCKER" image inspect -f '{{.Id}}' "$name" 2>/dev/null || true)"
  log "building $name$not_pulled"
  if ! nice -n "${CTJ_BUILD_NICE:-10}" "$DOCKER" build -q "${tags[@]}" "$ctx" >"$ctx.log" 2>&1; then
    tail -n 30 "$ctx.log" >&2
    log "building $name failed"
    return 1
  fi
  built=$((built + 1))
  log "built $name in $(( $(date +%s) - start ))s"
  # the image this one replaces, unless something still uses it
  if [ -n "$old" ] && [ "$old" != "$(id_of "$name")" ]; then "$DOCKER" rmi "$old" >/dev/null 2>&1 || true; fi
}

k="$CTJ_K8S_BIN_DIR"
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  PUBLISHED=1 image "registry.k8s.io/$c:$K8S_VERSION" "FROM $base
COPY --chmod=0755 bin/ /usr/local/bin/" "$base_id" "$k/$c"
done
PUBLISHED=1 image "registry.k8s.io/etcd:$etcd_tag" "FROM $base
COPY --chmod=0755 bin/ /usr/local/bin/
RUN mkdir -p /var/lib/etcd" "$base_id" "$CTJ_ETCD_BIN_DIR/etcd"

# iptables for kube-proxy and the route agent; Debian's default backend (nft) is the one
# kind's entrypoint selects on this host (its Docker rules are nft ones).
netbase="ctj/kind-netbase:bookworm"
image "$netbase" "FROM $base
RUN export DEBIAN_FRONTEND=noninteractive && apt-get update -qq \\
 && apt-get install -y -qq --no-install-recommends iptables nftables conntrack ipset iproute2 kmod \\
 && apt-get clean && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/*" "$base_id"
netbase_id="$(id_of "$netbase")"
PUBLISHED=1 image "registry.k8s.io/kube-proxy:$K8S_VERSION" "FROM $netbase
COPY --chmod=0755 bin/ /usr/local/bin/" "$netbase_id" "$CTJ_K8S_NODE_BIN_DIR/kube-proxy"

# The route agent's tag is the hash of its binary directory (its recipe): the CNI
# manifest in the node image names it, so a new agent means a new node image.
tools_dir="${CTJ_KIND_TOOLS_BIN_DIR%/bin}"
routes_tag="ctj/kind-routes:${tools_dir##*-}"
image "$routes_tag" "FROM $netbase
COPY --chmod=0755 bin/ctj-kind-routes /usr/local/bin/
ENTRYPOINT [\"/usr/local/bin/ctj-kind-routes\"]" "$netbase_id" "$CTJ_KIND_TOOLS_BIN_DIR/ctj-kind-routes"

# The NetworkPolicy enforcer, tagged by its version and build recipe (the directory's hash)
knp_dir="${CTJ_KUBE_NETWORK_POLICIES_BIN_DIR%/bin}"
knp_tag="ctj/kube-network-policies:${knp_dir##*/kube-network-policies-}"
image "$knp_tag" "FROM $netbase
COPY --chmod=0755 bin/kube-network-policies /usr/local/bin/
ENTRYPOINT [\"/usr/local/bin/kube-network-policies\"]" "$netbase_id" \
  "$CTJ_KUBE_NETWORK_POLICIES_BIN_DIR/kube-network-policies"

# kind's default StorageClass (storage.yaml): the provisioner, whose image serves as its
# helper pod too (sh, mkdir, rm from Debian; it runs as root there, non-root as the
# provisioner). Tagged by version and build recipe, as the binary's directory is named.
if [ "$mode" = "--check" ]; then lpp_paths="$("$kind_dir/local-path/build.sh" --check)" || exit 3
else lpp_paths="$("$kind_dir/local-path/build.sh")"; fi
eval "$lpp_paths"  # CTJ_LOCAL_PATH_BIN_DIR=...
lpp_dir="${CTJ_LOCAL_PATH_BIN_DIR%/bin}"
lpp_tag="ctj/local-path-provisioner:${lpp_dir##*/local-path-provisioner-}"
image "$lpp_tag" "FROM $base
COPY --chmod=0755 bin/local-path-provisioner /usr/local/bin/
ENTRYPOINT [\"/usr/local/bin/local-path-provisioner\"]" "$base_id" \
  "$CTJ_LOCAL_PATH_BIN_DIR/local-path-provisioner"

PUBLISHED=1 image "registry.k8s.io/coredns/coredns:$coredns_tag" "FROM scratch
COPY --chmod=0755 bin/coredns /coredns
EXPOSE 53 53/udp
ENTRYPOINT [\"/coredns\"]" "scratch" "$CTJ_COREDNS_BIN_DIR/coredns"

PUBLISHED=1 EXTRA_TAGS="registry.k8s.io/pause:3.10.1" image "registry.k8s.io/pause:3.10" "FROM scratch
COPY --chmod=0755 bin/pause /pause
USER 65535:65535
ENTRYPOINT [\"/pause\"]" "scratch" "$CTJ_KIND_TOOLS_BIN_DIR/pause"

# ---- the node image -------------------------------------------------------------
node_ctx="$work/node"
mkdir -p "$node_ctx/bin" "$node_ctx/kind/manifests"
if [ ! -d "$kind_mod/images/base/files" ]; then
  # the module cache is filled by building kind (cluster-binaries.sh --kind)
  log "kind's base files are missing: $kind_mod/images/base/files"; exit 1
fi
cp -r "$kind_mod/images/base/files" "$node_ctx/files"
chmod -R u+w "$node_ctx/files"
cp "$kind_dir/node/Dockerfile" "$kind_dir/node/containerd.sed" "$node_ctx/"
for b in "$CTJ_K8S_NODE_BIN_DIR"/{kubelet,kubeadm,kubectl} "$CTJ_CRICTL_BIN_DIR/crictl"; do
  ln "$b" "$node_ctx/bin/" 2>/dev/null || cp "$b" "$node_ctx/bin/"
done
printf '%s' "$K8S_VERSION" > "$node_ctx/kind/version"
sed "s#@ROUTES_IMAGE@#$routes_tag#" "$kind_dir/cni.yaml" > "$node_ctx/kind/manifests/default-cni.yaml"
sed "s#@LOCAL_PATH_IMAGE@#$lpp_tag#g" "$kind_dir/storage.yaml" > "$node_ctx/kind/manifests/default-storage.yaml"
node_key="$( { cat "$node_ctx/Dockerfile" "$node_ctx/containerd.sed"; (cd "$node_ctx" && find files kind -type f \
  | LC_ALL=C sort | xargs sha256sum); echo "$base_id $CTJ_K8S_NODE_BIN_DIR $CTJ_CRICTL_BIN_DIR"; } \
  | sha256sum | cut -c1-12)"
node_image="ctj/kind-node:$K8S_VERSION-$node_key"
if "$DOCKER" image inspect "$node_image" >/dev/null 2>&1; then
  :
elif [ "$mode" = "--check" ]; then
  stale+=("$node_image")
else
  start=$(date +%s)
  log "building $node_image (apt-get in the build: about a minute)"
  if ! nice -n "${CTJ_BUILD_NICE:-10}" "$DOCKER" build -q --build-arg "BASE_IMAGE=$base" \
      --label "ctj.inputs=$node_key" -t "$node_image" "$node_ctx" >"$work/node.log" 2>&1; then
    tail -n 40 "$work/node.log" >&2
    log "building $node_image failed"; exit 1
  fi
  built=$((built + 1))
  log "built $node_image in $(( $(date +%s) - start ))s"
  # older node images, unless a node container still runs one
  for old in $("$DOCKER" images --format '{{.Repository}}:{{.Tag}}' ctj/kind-node); do
    [ "$old" = "$node_image" ] || "$DOCKER" rmi "$old" >/dev/null 2>&1 || true
  done
fi

if (( ${#stale[@]} )); then log "missing or stale: ${stale[*]}"; exit 3; fi
(( built == 0 )) || log "$built image(s) built"
# every image the nodes' containerd store must hold (IMAGE=...), then the node image
for i in "registry.k8s.io/kube-apiserver:$K8S_VERSION" "registry.k8s.io/kube-controller-manager:$K8S_VERSION" \
         "registry.k8s.io/kube-scheduler:$K8S_VERSION" "registry.k8s.io/kube-proxy:$K8S_VERSION" \
         "registry.k8s.io/etcd:$etcd_tag" "registry.k8s.io/coredns/coredns:$coredns_tag" \
         "registry.k8s.io/pause:3.10" "registry.k8s.io/pause:3.10.1" "$routes_tag" "$knp_tag" \
         "$lpp_tag"; do
  echo "IMAGE=$i"
done
echo "NETWORK_POLICY_IMAGE=$knp_tag"
echo "ETCD_TAG=$etcd_tag"
echo "COREDNS_TAG=$coredns_tag"
echo "NODE_IMAGE=$node_image"
