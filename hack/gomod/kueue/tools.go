//go:build tools

// Package tools pins Kueue's manager so that `go mod tidy` keeps its modules.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"
