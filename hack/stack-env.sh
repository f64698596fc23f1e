#!/usr/bin/env bash
# Brings up (or reuses) everything the e2e tier and the kind demo run on, and prints the
# environment they read, as KEY=VALUE lines on stdout (progress goes to stderr):
#
#   CTJ_E2E_KUBECONFIG=...    the kind cluster hack/kind/cluster.sh builds (1 + 3 nodes;
#                             named by CTJ_KIND_CLUSTER, default ctj)
#   CTJ_OPERATOR_IMAGE=... CTJ_SIDECAR_IMAGE=... CTJ_TRAINER_IMAGE=... CTJ_SEAWEEDFS_IMAGE=...
#                             (hack/containers/images.sh's, all loaded on its nodes; the
#                             chart's sidecarImage is CTJ_SIDECAR_IMAGE: ctj_stack.Stack)
#   CTJ_E2E_NODE_STOP=docker kill {node}   CTJ_E2E_NODE_START=docker start {node}
#   CTJ_E2E_NODE_EXEC=docker exec {node}   (a command on a node: a trainer stopped by signal)
#
#   hack/stack-env.sh --prepare   builds all of it (Docker, our images, kind's binaries and
#                                 images, the image store, the loopback registry of the
#                                 pull path's test) but creates no cluster and prints
#                                 nothing: the test command runs it beside the other tiers,
#                                 so that no idle cluster shares the cores with them
#
# Exit 3, with one line saying why, when no container runtime can run on this machine
# (the e2e tier then skips with that reason); any other failure is an error.
set -euo pipefail
hack="$(cd "$(dirname "$0")" && pwd)"
if ! "$hack/containers/docker.sh" >&2; then
  echo "no container runtime can run here (hack/containers/docker.sh failed; see its log)"
  exit 3
fi
images="$("$hack/containers/images.sh")"
mapfile -t image_names < <(printf '%s\n' "$images" | cut -d= -f2)
"$hack/kind/cluster.sh" prepare "${image_names[@]}" >&2
# older builds of our images go, from Docker and from the kind store (running nodes keep
# what they have: their stores are copies)
"$hack/containers/images.sh" --prune "${image_names[@]}"
"$hack/kind/cluster.sh" prune "${image_names[@]}" >&2
if [ "${1:-}" = "--prepare" ]; then
  # the loopback registry the pull path's test runs (tests/e2e/test_registry_pull.py):
  # built here, in the background of the other tiers, not on the e2e tier's clock
  "$hack/registry/registry.sh" build >/dev/null
  exit 0
fi
kubeconfig="$("$hack/kind/cluster.sh" up | sed -n 's/^KUBECONFIG=//p')"
[ -n "$kubeconfig" ] || { echo "stack-env: hack/kind/cluster.sh up printed no KUBECONFIG" >&2; exit 1; }
"$hack/kind/cluster.sh" load "${image_names[@]}" >&2
echo "CTJ_E2E_KUBECONFIG=$kubeconfig"
printf '%s\n' "$images"
echo "CTJ_E2E_NODE_STOP=/usr/bin/docker kill {node}"
echo "CTJ_E2E_NODE_START=/usr/bin/docker start {node}"
echo "CTJ_E2E_NODE_EXEC=/usr/bin/docker exec {node}"
