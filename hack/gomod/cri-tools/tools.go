//go:build tools

// Package tools pins crictl (debugging inside kind nodes; Debian bookworm has no
// cri-tools) so that `go mod tidy` keeps its modules.
package tools

import _ "sigs.k8s.io/cri-tools/cmd/crictl"
