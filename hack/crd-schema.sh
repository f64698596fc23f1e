#!/usr/bin/env bash
# Regenerates the Kubernetes types embedded in the CRD (spec.template, a PodTemplateSpec;
# spec.checkpoint.sidecarResources) from a real API server's /openapi/v3, and copies
# crds/ to charts/ctj/crds/. How and why: hack/ctj_stack/crd_schema.py.
#
#   hack/crd-schema.sh                 an API server from the cluster tier's cached binaries
#   hack/crd-schema.sh --kubeconfig K  the API server of any cluster
#   hack/crd-schema.sh --openapi FILE  a saved /openapi/v3/api/v1 (--save-openapi writes one)
#   hack/crd-schema.sh --check         change nothing; exit 1 if the CRDs are not what it makes
#   hack/crd-schema.sh --local         only the rules on a job's name (operator/ctj_operator/
#                                      names.py): no API server
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$root/hack/env.sh"
exec python -m ctj_stack.crd_schema "$@"
