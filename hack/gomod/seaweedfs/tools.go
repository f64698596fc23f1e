//go:build tools

// Package tools pins SeaweedFS's `weed` command so that `go mod tidy` keeps its modules.
package tools

import _ "github.com/seaweedfs/seaweedfs/weed"
