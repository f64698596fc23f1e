//go:build tools

// Package tools pins JobSet's manager (its module root's main package) so that
// `go mod tidy` keeps its modules.
package tools

import _ "sigs.k8s.io/jobset"
