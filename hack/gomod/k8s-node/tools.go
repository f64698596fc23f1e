//go:build tools

// Package tools pins the node binaries hack/cluster-binaries.sh --kind builds from
// k8s.io/kubernetes for the kind node image (kept apart from ../k8s so that adding
// them does not change that module's recipe hash, nor rebuild the control plane).
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubeadm"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
