//go:build tools

// Package tools pins the Kubeflow training-operator's command so that `go mod tidy` keeps
// its modules.
package tools

import _ "github.com/kubeflow/training-operator/cmd/training-operator.v1"
