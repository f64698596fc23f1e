// Command etcd is upstream etcd's server, built from its Go module: the module
// proxy is reachable from our machines, GitHub release downloads are not.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
