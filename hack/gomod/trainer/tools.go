//go:build tools

// Package tools pins Kubeflow Trainer's controller manager so that `go mod tidy` keeps
// its modules.
package tools

import _ "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager"
