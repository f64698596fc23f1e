//go:build tools

// Package tools pins kube-network-policies' command (hack/cluster-binaries.sh --kind
// builds it) so that `go mod tidy` keeps its modules.
package tools

import _ "sigs.k8s.io/kube-network-policies/cmd"
