//go:build tools

// Package tools pins helm's command so that `go mod tidy` keeps its modules.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
