//go:build tools

// Package tools pins kind's command (hack/kind builds it) so that `go mod tidy`
// keeps its modules.
package tools

import _ "sigs.k8s.io/kind"
