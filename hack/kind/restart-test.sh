#!/usr/bin/env bash
# Kills a kind node's container and starts it again, then times how the cluster recovers:
# the node Ready again (a kubelet heartbeat newer than the start), the nettest pod on it
# Ready again, and the pod network checks (nettest.sh) passing from and to it.
#
#   hack/kind/restart-test.sh [--new-ip] [NODE]   NODE defaults to ctj-worker2
#     --new-ip   while the node is down, a placeholder container takes its IP on the kind
#                network, so the node comes back with another address
set -euo pipefail
kind_dir="$(cd "$(dirname "$0")" && pwd)"
hack="$(cd "$kind_dir/.." && pwd)"
cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
cluster="${CTJ_KIND_CLUSTER:-ctj}"
DOCKER=/usr/bin/docker
new_ip=0
if [ "${1:-}" = "--new-ip" ]; then new_ip=1; shift; fi
node="${1:-$cluster-worker2}"
eval "$("$hack/cluster-binaries.sh" --kind-check)"
k() { "$CTJ_K8S_NODE_BIN_DIR/kubectl" --kubeconfig "$cache/kind/$cluster.kubeconfig" "$@"; }
t0=$(date +%s.%N)
t() { awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { printf "%6.1fs", a - b }'; }
log() { printf 'restart-test: [%s] %s\n' "$(t)" "$*" >&2; }

# the nettest DaemonSet must be running (it gives every node a pod to check)
k -n ctj-nettest get ds nettest >/dev/null 2>&1 || "$kind_dir/nettest.sh" --keep >/dev/null

old_ip="$("$DOCKER" inspect -f '{{(index .NetworkSettings.Networks "kind").IPAddress}}' "$node")"
t0=$(date +%s.%N)
log "docker kill $node (IP $old_ip)"
"$DOCKER" kill "$node" >/dev/null
placeholder=""
if (( new_ip )); then
  placeholder="ctj-ip-placeholder"
  "$DOCKER" rm -f "$placeholder" >/dev/null 2>&1 || true
  # Docker hands out the lowest free address (kind's network has no user-set IPv4 range,
  # so --ip is refused): the placeholder gets the node's
  "$DOCKER" run -d --name "$placeholder" --network kind ctj/debian:bookworm sleep 3600 >/dev/null
  log "placeholder container holds $("$DOCKER" inspect -f '{{(index .NetworkSettings.Networks "kind").IPAddress}}' "$placeholder")"
fi
start_epoch=$(date -u +%s)
log "docker start $node"
"$DOCKER" start "$node" >/dev/null
ip="$("$DOCKER" inspect -f '{{(index .NetworkSettings.Networks "kind").IPAddress}}' "$node")"
log "$node running, IP $ip"

# a Ready condition whose heartbeat is newer than the start
while :; do
  read -r status hb < <(echo "$(k get node "$node" -o \
    jsonpath='{.status.conditions[?(@.type=="Ready")].status} {.status.conditions[?(@.type=="Ready")].lastHeartbeatTime}' 2>/dev/null || echo "? ?")")
  if [ "$status" = True ] && [ "$(date -u -d "$hb" +%s 2>/dev/null || echo 0)" -ge "$start_epoch" ]; then break; fi
  sleep 1
done
log "node $node Ready (heartbeat $hb), InternalIP $(k get node "$node" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')"

pod=""
while :; do
  pod="$(k -n ctj-nettest get pods -l app=nettest --field-selector "spec.nodeName=$node" \
    -o jsonpath='{range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status} {.status.conditions[?(@.type=="Ready")].lastTransitionTime}{"\n"}{end}' 2>/dev/null \
    | awk -v s="$start_epoch" '$2 == "True" { cmd = "date -u -d " $3 " +%s"; cmd | getline e; close(cmd); if (e >= s) print $1 }' | head -n1)"
  [ -z "$pod" ] || break
  sleep 1
done
log "nettest pod $pod on $node Ready again, pod IP $(k -n ctj-nettest get pod "$pod" -o jsonpath='{.status.podIP}')"

# routes on the other nodes follow the new address
for n in $("$DOCKER" ps --filter "label=io.x-k8s.kind.cluster=$cluster" --format '{{.Names}}'); do
  [ "$n" = "$node" ] || printf '  route on %s: %s\n' "$n" \
    "$("$DOCKER" exec "$n" ip -4 route show proto 77 | grep "via $ip " || echo "none via $ip yet")"
done
if "$kind_dir/nettest.sh" --keep; then log "pod network checks passed"; rc=0; else log "pod network checks FAILED"; rc=1; fi
if [ -n "$placeholder" ]; then "$DOCKER" rm -f "$placeholder" >/dev/null; fi
exit "$rc"
