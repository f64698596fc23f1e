#!/usr/bin/env bash
# A multi-node kind cluster built entirely on this machine (no registry): 1 control plane +
# ${CTJ_KIND_WORKERS:-3} workers, named ${CTJ_KIND_CLUSTER:-ctj}.
#
#   hack/kind/cluster.sh prepare [IMAGE...]  build what is missing and put it (and the local
#                                      Docker images named) into the store; create nothing.
#                                      A cluster made after it starts with them on every node
#   hack/kind/cluster.sh up            build what is missing, create the cluster unless it is
#                                      running and healthy, print KUBECONFIG=<path>
#   hack/kind/cluster.sh load IMAGE... make local Docker images available to every node: put
#                                      into the shared store once, hardlinked into each node
#                                      (kept across down/up); --copy: plain `kind load
#                                      docker-image` instead (a full copy per node)
#   hack/kind/cluster.sh unload IMAGE... remove images from every node and from the store
#   hack/kind/cluster.sh down          delete the cluster (the store and the images stay)
#   hack/kind/cluster.sh status        the nodes, and whether the cluster is usable (exit 0) or not
#   hack/kind/cluster.sh prune [IMAGE...]  drop from the store every loaded image not named
#
# Everything it makes lives under ${CTJ_CACHE:-~/.cache/ctj}/kind: <cluster>.kubeconfig,
# store/ (one containerd image store, store.sh), nodes/<cluster>/<node>/containerd (each
# node's /var/lib/containerd: a hardlinked copy of the store), <cluster>.inputs (what the
# running cluster was made from). See README.md.
#
# NetworkPolicies are enforced (kube-network-policies, one per node: hack/kind/network-policies),
# installed by up on a new cluster and on one made before it; CTJ_KIND_NETWORK_POLICY=0 leaves
# it out (policies are then stored but not enforced, as on kind's own network).
set -euo pipefail
kind_dir="$(cd "$(dirname "$0")" && pwd)"
hack="$(cd "$kind_dir/.." && pwd)"
cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
state="$cache/kind"
cluster="${CTJ_KIND_CLUSTER:-ctj}"
workers="${CTJ_KIND_WORKERS:-3}"
kubeconfig="$state/$cluster.kubeconfig"
nodes_dir="$state/nodes/$cluster"
DOCKER=/usr/bin/docker
# kind runs `docker`: Debian's CLI (the daemon's own version), not a newer one on PATH
export PATH="/usr/bin:$PATH"
t_start=$(date +%s)
log() { printf 'kind-cluster: [%3ss] %s\n' "$(( $(date +%s) - t_start ))" "$*" >&2; }
die() { log "$*"; exit 1; }

node_names() {
  echo "$cluster-control-plane"
  local i
  for (( i = 1; i <= workers; i++ )); do
    if (( i == 1 )); then echo "$cluster-worker"; else echo "$cluster-worker$i"; fi
  done
}

# binaries (paths) and images (names), building what is missing unless --check
tools() {
  local paths
  if ! paths="$("$hack/cluster-binaries.sh" --kind-check 2>/dev/null)"; then
    [ "${1:-}" != "--check" ] || return 3
    paths="$("$hack/cluster-binaries.sh" --kind)"
  fi
  eval "$paths"
  KIND="$CTJ_KIND_BIN_DIR/kind"
  KUBECTL="$CTJ_K8S_NODE_BIN_DIR/kubectl"
}
kubectl() { "$KUBECTL" --kubeconfig "$kubeconfig" "$@"; }
images_info() {
  local out
  out="$("$kind_dir/images.sh" "$@")" || return $?
  mapfile -t IMAGES < <(sed -n 's/^IMAGE=//p' <<<"$out")
  NODE_IMAGE="$(sed -n 's/^NODE_IMAGE=//p' <<<"$out")"
  ETCD_TAG="$(sed -n 's/^ETCD_TAG=//p' <<<"$out")"
  COREDNS_TAG="$(sed -n 's/^COREDNS_TAG=//p' <<<"$out")"
  NETWORK_POLICY_IMAGE="$(sed -n 's/^NETWORK_POLICY_IMAGE=//p' <<<"$out")"
}
netpol_on() { [ "${CTJ_KIND_NETWORK_POLICY:-1}" != 0 ]; }

# install_network_policy: the enforcer's DaemonSet (hack/kind/network-policies), applied
# whether the cluster is new or older than it (kubectl apply: unchanged is a no-op);
# retried while a just-started API server does not answer yet
install_network_policy() {
  netpol_on || return 0
  local manifest deadline=$(( $(date +%s) + 90 ))
  manifest="$(sed "s#@IMAGE@#$NETWORK_POLICY_IMAGE#" "$kind_dir/network-policies/kube-network-policies.yaml")"
  until kubectl apply --request-timeout=10s -f - <<<"$manifest" >/dev/null; do
    (( $(date +%s) < deadline )) || die "could not apply the NetworkPolicy enforcer (kube-network-policies)"
    sleep 2
  done
}

# pin_dns: CoreDNS on the control plane, where kind first places it, whatever reschedules
# it (the e2e tier's health test scales it to 0 and back): a worker that a test stops must
# not take half the cluster's DNS with it. Its Service keeps a lost node's replica as an
# endpoint until the node-monitor grace (40-50 s) ends, and every lookup sent there times
# out: measured, the sidecars' start and the ranks' rendezvous after a node loss took
# 21-42 s longer. A no-op once pinned; retried while the API server is not answering yet.
pin_dns() {
  local patch='{"spec":{"template":{"spec":{"nodeSelector":{"node-role.kubernetes.io/control-plane":""}}}}}'
  local deadline=$(( $(date +%s) + 90 ))
  until kubectl -n kube-system patch deployment coredns --request-timeout=10s -p "$patch" >/dev/null; do
    (( $(date +%s) < deadline )) || die "could not pin CoreDNS to the control plane"
    sleep 2
  done
}

cluster_exists() { "$KIND" get clusters 2>/dev/null | grep -qx "$cluster"; }

# healthy: every node Ready, CoreDNS and the route agent ready (prints what is missing)
healthy() {
  local want=$(( workers + 1 )) ready dns routes proxies
  ready="$(kubectl get nodes --request-timeout=5s -o \
    jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' 2>/dev/null \
    | grep -c '^True$' || true)"
  dns="$(kubectl -n kube-system get deploy coredns --request-timeout=5s \
    -o jsonpath='{.status.readyReplicas}/{.spec.replicas}' 2>/dev/null || true)"
  routes="$(kubectl -n kube-system get ds ctj-kind-routes --request-timeout=5s \
    -o jsonpath='{.status.numberReady}/{.status.desiredNumberScheduled}' 2>/dev/null || true)"
  proxies="$(kubectl -n kube-system get ds kube-proxy --request-timeout=5s \
    -o jsonpath='{.status.numberReady}/{.status.desiredNumberScheduled}' 2>/dev/null || true)"
  HEALTH="nodes Ready $ready/$want, coredns ${dns:-?}, kube-proxy ${proxies:-?}, ctj-kind-routes ${routes:-?}"
  local netpol="1/1"
  if netpol_on; then
    netpol="$(kubectl -n kube-system get ds kube-network-policies --request-timeout=5s \
      -o jsonpath='{.status.numberReady}/{.status.desiredNumberScheduled}' 2>/dev/null || true)"
    HEALTH+=", kube-network-policies ${netpol:-?}"
  fi
  if [ -n "${SINCE:-}" ]; then
    # nodes just started: a Ready condition can be the one from before they stopped; a
    # kubelet that renewed its Lease since then is the new one
    local renewed
    renewed="$(kubectl -n kube-node-lease get lease --request-timeout=5s \
      -o jsonpath='{range .items[*]}{.spec.renewTime}{"\n"}{end}' 2>/dev/null \
      | while read -r t; do [ "$(date -u -d "$t" +%s 2>/dev/null || echo 0)" -lt "$SINCE" ] || echo x; done | grep -c x || true)"
    HEALTH+=", kubelets back $renewed/$want"
    [ "$renewed" = "$want" ] || return 1
    # and the pods Services and DNS need, Ready again since the start (their old Ready
    # conditions, and the Deployment's counts, say nothing yet)
    local sel pods
    for sel in k8s-app=kube-dns k8s-app=kube-proxy k8s-app=ctj-kind-routes; do
      pods="$(kubectl -n kube-system get pods -l "$sel" --request-timeout=5s -o \
        jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status} {.status.conditions[?(@.type=="Ready")].lastTransitionTime}{"\n"}{end}' 2>/dev/null \
        | while read -r st t; do
            if [ "$st" = True ] && [ "$(date -u -d "$t" +%s 2>/dev/null || echo 0)" -ge "$SINCE" ]; then echo ok; else echo old; fi
          done)"
      if [ -z "$pods" ] || grep -q old <<<"$pods"; then HEALTH+=", ${sel#k8s-app=} pods not Ready again"; return 1; fi
    done
  fi
  [ "$ready" = "$want" ] && all_of "$dns" && all_of "$routes" && all_of "$proxies" && all_of "$netpol"
}
# all_of N/M: N == M > 0
all_of() { [[ "$1" =~ ^([0-9]+)/([0-9]+)$ ]] && (( BASH_REMATCH[1] == BASH_REMATCH[2] && BASH_REMATCH[2] > 0 )); }

wait_healthy() {
  local timeout="$1" deadline=$(( $(date +%s) + $1 )) last=""
  while :; do
    if healthy; then log "healthy: $HEALTH"; return 0; fi
    if [ "$HEALTH" != "$last" ]; then log "waiting: $HEALTH"; last="$HEALTH"; fi
    (( $(date +%s) < deadline )) || { log "not healthy after ${timeout}s: $HEALTH"; return 1; }
    sleep 2
  done
}

# what a cluster is made from: the kind config this script would write now
inputs_key() { write_config /dev/stdout | sha256sum | cut -c1-16; }

write_config() {
  local cfg="$1" n role
  {
    cat <<EOF
# generated by hack/kind/cluster.sh
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
name: $cluster
kubeadmConfigPatches:
- |
  kind: ClusterConfiguration
  etcd:
    local:
      imageTag: "$ETCD_TAG"
  dns:
    imageTag: "$COREDNS_TAG"
nodes:
EOF
    for n in $(node_names); do
      if [ "$n" = "$cluster-control-plane" ]; then role=control-plane; else role=worker; fi
      cat <<EOF
- role: $role
  image: $NODE_IMAGE
  extraMounts:
  - hostPath: $nodes_dir/$n/containerd
    containerPath: /var/lib/containerd
EOF
    done
  } > "$cfg"
}

# kind's known issue: each node (systemd, containerd, kubelet, kube-proxy) holds inotify
# instances of the host's root user, so two clusters' nodes exhaust the default 128 and
# kube-proxy fails on the nodes made last ("too many open files"): no Service, no DNS.
# Raised to kind's recommended values where lower, or the reason given.
INOTIFY_LIMITS=(fs.inotify.max_user_instances=512 fs.inotify.max_user_watches=524288)
inotify_limits() {
  local setting key want have
  for setting in "${INOTIFY_LIMITS[@]}"; do
    key="${setting%=*}" want="${setting#*=}"
    have="$(sysctl -n "$key")"
    (( have >= want )) && continue
    sysctl -qw "$key=$want" >/dev/null 2>&1 \
      || die "$key is $have, under kind's $want for several clusters' nodes: run 'sysctl -w $key=$want' as root"
    log "raised $key from $have to $want (kind's limit for more than one cluster's nodes)"
  done
}

create() {
  local start n
  log "creating cluster $cluster: 1 control plane + $workers workers from $NODE_IMAGE"
  rm -rf "$nodes_dir"
  start=$(date +%s)
  for n in $(node_names); do "$kind_dir/store.sh" clone "$nodes_dir/$n/containerd"; done
  log "node stores cloned (hardlinks) in $(( $(date +%s) - start ))s"
  write_config "$state/$cluster.kind.yaml"
  start=$(date +%s)
  if ! "$KIND" create cluster --config "$state/$cluster.kind.yaml" --kubeconfig "$kubeconfig" \
       --wait 0s 2>&1 | sed -u 's/^/  kind: /' >&2; then
    die "kind create cluster failed (leaving nothing behind: run '$0 down' to be sure)"
  fi
  log "kind create cluster took $(( $(date +%s) - start ))s"
  inputs_key > "$state/$cluster.inputs"
}

cmd_prepare() {
  tools
  images_info
  "$kind_dir/store.sh" add "${IMAGES[@]}" "$@"
  log "prepared in $(( $(date +%s) - t_start ))s"
}

cmd_up() {
  inotify_limits
  tools
  images_info
  "$kind_dir/store.sh" add "${IMAGES[@]}"
  mkdir -p "$state"
  if cluster_exists; then
    local n stopped=()
    for n in $(node_names); do
      [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$n" 2>/dev/null)" = true ] || stopped+=("$n")
    done
    if (( ${#stopped[@]} )); then
      log "starting stopped nodes: ${stopped[*]}"
      SINCE=$(date -u +%s)
      "$DOCKER" start "${stopped[@]}" >/dev/null
    fi
    "$KIND" get kubeconfig --name "$cluster" > "$kubeconfig.tmp" && mv "$kubeconfig.tmp" "$kubeconfig"
    [ -f "$state/$cluster.inputs" ] || inputs_key > "$state/$cluster.inputs"  # no record: adopt it
    if [ "$(cat "$state/$cluster.inputs")" != "$(inputs_key)" ]; then
      log "note: cluster $cluster was made from another kind config (node image, workers, tags);"
      log "      '$0 down && $0 up' recreates it from the current ones"
    fi
    if netpol_on; then
      # a cluster made before the enforcer was: its nodes' stores are older clones
      for n in $(node_names); do
        "$kind_dir/store.sh" link "$n" "$nodes_dir/$n/containerd" "$NETWORK_POLICY_IMAGE"
      done
    fi
    install_network_policy
    pin_dns
    if wait_healthy "${CTJ_KIND_WAIT_EXISTING:-180}"; then
      echo "KUBECONFIG=$kubeconfig"; return 0
    fi
    log "cluster $cluster exists but is not healthy: recreating it"
    "$KIND" delete cluster --name "$cluster" >&2
  fi
  create
  install_network_policy
  pin_dns
  wait_healthy "${CTJ_KIND_WAIT:-300}" || die "cluster $cluster did not become healthy ($0 status)"
  # images loaded into the store by earlier `load`s are in every node already (cloned)
  log "up in $(( $(date +%s) - t_start ))s"
  echo "KUBECONFIG=$kubeconfig"
}

cmd_load() {
  local copy=0
  if [ "${1:-}" = "--copy" ]; then copy=1; shift; fi
  (( $# )) || die "usage: $0 load [--copy] IMAGE..."
  tools --check || die "nothing built yet: run '$0 up' first"
  cluster_exists || die "no cluster $cluster: run '$0 up' first"
  local start img n
  start=$(date +%s)
  if (( copy )); then
    "$KIND" load docker-image --name "$cluster" "$@" >&2
    for n in $(node_names); do discard_layer_blobs "$n"; done
  else
    "$kind_dir/store.sh" add "$@"
    for n in $(node_names); do
      "$kind_dir/store.sh" link "$n" "$nodes_dir/$n/containerd" "$@"
    done
  fi
  log "loaded $* in $(( $(date +%s) - start ))s"
}

# discard_layer_blobs NODE: drop the layer blobs of every image in NODE's containerd (what
# kind's discard_unpacked_layers does for pulls; `kind load` keeps them): containers run
# from the unpacked snapshots, and the blobs double the disk an image takes
discard_layer_blobs() {
  "$DOCKER" exec "$1" sh -c '
    c="ctr -n k8s.io"
    for t in $($c images ls | awk "NR > 1 { print \$3 }" | sort -u); do
      m="$($c content get "$t" 2>/dev/null)" || continue
      for sub in $(echo "$m" | jq -r ".manifests[]?.digest"); do
        $c content get "$sub" 2>/dev/null | jq -r ".layers[]?.digest"
      done
      echo "$m" | jq -r ".layers[]?.digest"
    done | sort -u | xargs -r $c content rm >/dev/null 2>&1 || true' || true
}

# unload IMAGE...: remove images from every node (all their tags: crictl rmi by image ID;
# the kubelet's own references included) and from the store
cmd_unload() {
  (( $# )) || die "usage: $0 unload IMAGE..."
  tools --check || die "nothing built yet"
  local img n id
  for img in "$@"; do
    for n in $(node_names); do
      id="$("$DOCKER" exec "$n" crictl inspecti -o go-template --template '{{.status.id}}' "$img" 2>/dev/null || true)"
      [ -z "$id" ] || "$DOCKER" exec "$n" crictl rmi "$id" >/dev/null
      # `kind load` leaves an import-<date>@sha256:... record behind
      "$DOCKER" exec "$n" sh -c 'ctr -n k8s.io images ls -q | grep -E "^import-[0-9-]+@sha256:" | xargs -r ctr -n k8s.io images rm' >/dev/null 2>&1 || true
    done
  done
  for n in $(node_names); do discard_layer_blobs "$n"; done
  "$kind_dir/store.sh" drop "$@"
  log "unloaded $*"
}

cmd_down() {
  tools --check || tools
  if cluster_exists; then "$KIND" delete cluster --name "$cluster" >&2; fi
  rm -rf "$nodes_dir" "$kubeconfig" "$state/$cluster.inputs"
  log "cluster $cluster deleted"
}

cmd_status() {
  tools --check || die "nothing built yet: run '$0 up'"
  if ! cluster_exists; then echo "cluster $cluster: not created"; return 1; fi
  "$DOCKER" ps -a --filter "label=io.x-k8s.kind.cluster=$cluster" \
    --format 'table {{.Names}}\t{{.Status}}\t{{.Image}}'
  echo
  kubectl get nodes -o wide 2>&1 || true
  echo
  if healthy; then echo "cluster $cluster: usable ($HEALTH)"; echo "KUBECONFIG=$kubeconfig"
  else echo "cluster $cluster: NOT usable ($HEALTH)"; return 1; fi
}

cmd_prune() {
  tools --check || die "nothing built yet"
  images_info --check || die "images are not built"
  "$kind_dir/store.sh" prune "${IMAGES[@]}" "$@"
}

sub="${1:-}"; shift || true
# one up/load/down/prune at a time per cluster (the store has a lock of its own)
case "$sub" in prepare|up|load|unload|down|prune) mkdir -p "$state"; exec 8>"$state/$cluster.lock"; flock 8 ;; esac
case "$sub" in
  prepare) cmd_prepare "$@" ;;
  up) cmd_up ;;
  load) cmd_load "$@" ;;
  unload) cmd_unload "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  prune) cmd_prune "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
