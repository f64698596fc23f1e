#!/usr/bin/env bash
# Checks the kind cluster's pod network: one pod on every node (a DaemonSet of a small
# image built here and loaded through the store), then from every pod: ping every other
# pod, resolve a Service name through CoreDNS, and reach the API server's Service IP.
#
#   hack/kind/nettest.sh          run the checks, print a line per check, exit 1 if any failed
#   hack/kind/nettest.sh --keep   leave the DaemonSet (namespace ctj-nettest) running
set -euo pipefail
kind_dir="$(cd "$(dirname "$0")" && pwd)"
hack="$(cd "$kind_dir/.." && pwd)"
cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
cluster="${CTJ_KIND_CLUSTER:-ctj}"
DOCKER=/usr/bin/docker
image="ctj/kind-nettest:bookworm"
eval "$("$hack/cluster-binaries.sh" --kind-check)"
k() { "$CTJ_K8S_NODE_BIN_DIR/kubectl" --kubeconfig "$cache/kind/$cluster.kubeconfig" "$@"; }
log() { printf 'nettest: %s\n' "$*" >&2; }

if ! "$DOCKER" image inspect "$image" >/dev/null 2>&1; then
  log "building $image"
  DOCKER_BUILDKIT=1 "$DOCKER" build -q -t "$image" - >/dev/null <<'EOF'
FROM ctj/debian:bookworm
RUN export DEBIAN_FRONTEND=noninteractive && apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends iputils-ping dnsutils curl ca-certificates \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
EOF
fi
"$kind_dir/cluster.sh" load "$image"

k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: ctj-nettest}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: nettest, namespace: ctj-nettest}
spec:
  selector: {matchLabels: {app: nettest}}
  template:
    metadata: {labels: {app: nettest}}
    spec:
      tolerations: [{operator: Exists}]
      terminationGracePeriodSeconds: 1
      containers:
      - name: t
        image: $image
        imagePullPolicy: Never
        command: [sleep, infinity]
---
apiVersion: v1
kind: Service
metadata: {name: nettest, namespace: ctj-nettest}
spec:
  clusterIP: None
  selector: {app: nettest}
  ports: [{port: 80}]
EOF
k -n ctj-nettest rollout status ds/nettest --timeout=180s >&2
mapfile -t pods < <(k -n ctj-nettest get pods -l app=nettest \
  -o jsonpath='{range .items[*]}{.metadata.name} {.spec.nodeName} {.status.podIP}{"\n"}{end}')
gateway="$("$DOCKER" network inspect kind -f '{{range .IPAM.Config}}{{.Gateway}} {{end}}' | awk '{ print $1 }')"
fail=0
check() {  # check LABEL CMD...
  local label="$1"; shift
  if out="$("$@" 2>&1)"; then printf 'ok    %s\n' "$label"
  else printf 'FAIL  %s: %s\n' "$label" "$(tail -n 2 <<<"$out" | tr '\n' ' ')"; fail=1; fi
}
for p in "${pods[@]}"; do
  read -r name node ip <<<"$p"
  for q in "${pods[@]}"; do
    read -r _ qnode qip <<<"$q"
    [ "$qip" != "$ip" ] || continue
    check "ping $node ($ip) -> $qnode ($qip)" k -n ctj-nettest exec "$name" -- ping -c 2 -W 2 -q "$qip"
  done
  check "out  $node: ping the Docker network's gateway $gateway (masqueraded)" \
    k -n ctj-nettest exec "$name" -- ping -c 2 -W 2 -q "$gateway"
  check "dns  $node: kubernetes.default.svc.cluster.local" \
    k -n ctj-nettest exec "$name" -- getent hosts kubernetes.default.svc.cluster.local
  check "dns  $node: nettest.ctj-nettest (headless, $(( ${#pods[@]} )) pods)" \
    k -n ctj-nettest exec "$name" -- sh -c "[ \$(dig +short +search nettest.ctj-nettest | wc -l) -eq ${#pods[@]} ]"
  check "svc  $node: https://kubernetes.default/livez via the Service IP" \
    k -n ctj-nettest exec "$name" -- curl -sk --max-time 5 -o /dev/null -w '%{http_code}' https://kubernetes.default/livez
done
if [ "${1:-}" != "--keep" ]; then k delete ns ctj-nettest --wait=false >/dev/null; fi
if (( fail )); then log "some checks failed"; exit 1; fi
log "all checks passed"
