"""One simulated node's settings (node_agent.py runs the node; pod_worker.py reads them)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(kw_only=True)
class NodeAgentConfig:
    """One simulated node."""

    name: str
    index: int
    """1..250: the node's address is <net>.<index>.1 and its pods get <net>.<index>.2-254."""
    net: str = "127.10"
    """The cluster's /16 of loopback addresses (one per cluster running on this machine)."""
    kubeconfig: Path
    root: Path
    """The node's directory: pod logs, volumes, exec specs."""
    dns_dir: Path
    api_host: str
    api_port: int
    kubelet_version: str = "v1.34.4"
    cpu: str = "4"
    memory: str = "8Gi"
    max_pods: int = 110
    extended_resources: dict[str, str] = field(default_factory=dict)
    """e.g. {"nvidia.com/gpu": "2"}: advertised capacity, nothing more."""
    labels: dict[str, str] = field(default_factory=dict)
    image_entrypoints: dict[str, list[str]] = field(default_factory=dict)
    """Image repository -> command, for containers that rely on their image's ENTRYPOINT
    (e.g. a Helm chart's operator Deployment): there are no images here."""
    lease_duration_seconds: int = 40
    lease_renew_interval: float = 1.0
    status_update_interval: float = 10.0
    restart_backoff: float = 1.0
    max_restart_backoff: float = 10.0
    serving_cert: str = ""
    """Certificate and key for the kubelet API (kubectl logs); empty: not served."""
    serving_key: str = ""
    client_ca: str = ""
    """CA whose client certificates (the API server's) the kubelet API accepts."""
    kubelet_port: int = 0
    """The kubelet API's port on the node IP; 0: whatever the kernel gives when it binds
    (no race with anyone), posted in the Node's daemonEndpoints either way."""
    shm_root: str = "/dev/shm/ctj-devcluster/default"
    """Where memory-backed emptyDirs live (tmpfs); the launcher removes it at teardown, so
    volumes of pods on a killed node do not hold memory after the cluster is gone."""
    python_bin_dir: str = field(default_factory=lambda: os.path.dirname(sys.executable))
    """Put first on every container's PATH, so a command ``python`` is the venv's python."""

    def __post_init__(self) -> None:
        self.kubeconfig, self.root, self.dns_dir = (
            Path(self.kubeconfig),
            Path(self.root),
            Path(self.dns_dir),
        )
        if not re.fullmatch(r"127\.\d{1,3}", self.net):
            raise ValueError(f"net {self.net!r} is not a 127.X loopback /16")
        if not 1 <= self.index <= 250:
            raise ValueError(f"node index {self.index} not in 1..250")
        if not self.name or self.name != self.name.lower():
            raise ValueError(f"node name {self.name!r} must be a lowercase DNS label")
        if (
            self.lease_renew_interval <= 0
            or self.lease_renew_interval * 2 > self.lease_duration_seconds
        ):
            raise ValueError("lease_renew_interval must be positive and under half the lease")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> NodeAgentConfig:
        return cls(**json.loads(text))
