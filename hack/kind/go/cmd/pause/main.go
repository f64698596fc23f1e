// Command pause is the pod sandbox's process (the image kind's containerd config and
// kubeadm call registry.k8s.io/pause): it holds the pod's namespaces, reaps the
// zombies it inherits as PID 1 of a shared PID namespace, and exits 0 on SIGINT or
// SIGTERM, like upstream's C pause. Built here because no registry is reachable.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Println("pause (ctj, Go)")
		return
	}
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
