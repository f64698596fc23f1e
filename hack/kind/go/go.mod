// ctj's own small programs for the kind cluster (hack/kind): the pod sandbox's pause
// process and the route agent that is the cluster's CNI. Standard library only.
module ctj.dev/hack/kind

go 1.24.0
