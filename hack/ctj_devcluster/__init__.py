"""ctj's local Kubernetes: a real control plane built from Go modules, simulated nodes.

What controller-runtime's envtest and kwok give Go operators, for a machine with no
Docker: etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback,
plus node agents that run pods' containers as local processes. See docs/dev-cluster.md.
"""

from .binaries import Binaries, BinariesMissing, find_binaries
from .cluster import Cluster, ClusterConfig, NodeHandle

__all__ = ["Binaries", "BinariesMissing", "Cluster", "ClusterConfig", "NodeHandle", "find_binaries"]
