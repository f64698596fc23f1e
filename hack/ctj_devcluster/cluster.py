"""A whole local cluster: the control plane, cluster DNS and simulated nodes.

This is what the pytest fixture and ``python -m ctj_devcluster`` drive. ``start()`` returns
once the API server, controller manager and scheduler are healthy, every node is Ready and
the ``default`` service account exists (pods can be created right away); ``stop()`` (also
on any failure in ``start()``) stops everything it started, newest first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .binaries import HACK_DIR, Binaries, find_binaries
from .controlplane import ControlPlane, ControlPlaneConfig
from .kubeconfig import write_kubeconfig
from .node_config import NodeAgentConfig
from .processes import ManagedProcess, wait_until

DNS_USER = "ctj:dns"


@dataclass(kw_only=True)
class ClusterConfig:
    root: Path
    nodes: int = 2
    node_cpu: str = "4"
    node_memory: str = "8Gi"
    node_extended_resources: dict[str, str] = field(default_factory=dict)
    image_entrypoints: dict[str, list[str]] = field(default_factory=dict)
    """Image repository -> command, for containers without a command (see NodeAgentConfig)."""
    node_monitor_grace_period: float = 10.0
    node_monitor_period: float = 1.0
    start_timeout: float = 90.0
    net: str = ""
    """Loopback /16 for node and pod addresses, e.g. "127.10"; empty: the first free one.
    Claimed for the cluster's lifetime either way (a second cluster cannot take it)."""
    audit_log: bool = False
    """The API server logs every request (level Metadata, JSON) to ``root/audit.log``:
    ``Cluster.audit_log_path``, read with ``ctj_devcluster.audit``."""

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not 0 <= self.nodes <= 250:
            raise ValueError("nodes must be in 0..250")


@dataclass
class NodeHandle:
    name: str
    config: NodeAgentConfig
    process: ManagedProcess


class Cluster:
    def __init__(self, config: ClusterConfig, binaries: Binaries | None = None) -> None:
        self.config = config
        self.binaries = binaries or find_binaries()
        self.control_plane = ControlPlane(
            ControlPlaneConfig(
                root=config.root,
                node_monitor_grace_period=config.node_monitor_grace_period,
                node_monitor_period=config.node_monitor_period,
                start_timeout=config.start_timeout,
                audit_log=config.audit_log,
            ),
            self.binaries,
        )
        self.nodes: dict[str, NodeHandle] = {}
        self.net, self._net_claim = _claim_loopback_net(config.net)
        root_id = hashlib.sha256(str(config.root.resolve()).encode()).hexdigest()[:10]
        self.shm_root = Path("/dev/shm/ctj-devcluster") / root_id
        self.dns: ManagedProcess | None = None
        self._next_index = 1
        self.started_in: float = 0.0

    # --- paths and clients ---------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.control_plane.admin_kubeconfig

    @property
    def audit_log_path(self) -> Path:
        """The API server's audit log (with ``ClusterConfig.audit_log``)."""
        return self.control_plane.audit_log_path

    @property
    def dns_dir(self) -> Path:
        return self.config.root / "dns"

    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG and PATH with kubectl and helm first."""
        path = f"{self.binaries.kubectl.parent}:{self.binaries.helm.parent}:{os.environ['PATH']}"
        helm_home = self.config.root / "helm"
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": path,
            "HELM_CACHE_HOME": str(helm_home / "cache"),
            "HELM_CONFIG_HOME": str(helm_home / "config"),
            "HELM_DATA_HOME": str(helm_home / "data"),
        }

    def service_account_kubeconfig(
        self, namespace: str, name: str, path: Path, duration: str = "1h"
    ) -> Path:
        """A kubeconfig that is only the service account (a token for it, no admin
        certificate): what a pod, or the operator deployed, can do."""
        token = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={duration}"
        ).stdout.strip()
        admin = json.loads(Path(self.kubeconfig).read_text())
        cluster = admin["clusters"][0]["name"]
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": admin["clusters"],
                    "users": [{"name": name, "user": {"token": token}}],
                    "contexts": [{"name": name, "context": {"cluster": cluster, "user": name}}],
                    "current-context": name,
                }
            )
        )
        return path

    def api_client(self) -> Any:
        from kubernetes import config as kconfig

        return kconfig.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self._run(self.binaries.kubectl, args, check, timeout, input)

    def wait_crd_established(self, crd: str, timeout: float = 60) -> None:
        wait_crd_established(lambda *a: self.kubectl(*a, check=False).stdout, crd, timeout)

    def helm(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run(self.binaries.helm, args, check, timeout, None)

    def _run(
        self, binary: Path, args: Sequence[str], check: bool, timeout: float, input: str | None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(binary), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{binary.name} {' '.join(args)} failed ({proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        return proc

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> Cluster:
        t0 = time.monotonic()
        try:
            self.control_plane.start(with_apiserver=self._start_dns_and_nodes)
            self._grant_dns()
            for name in self.nodes:
                self.wait_node_ready(name)
            self._wait_default_service_account()
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - t0
        self._write_state()
        return self

    def _start_dns_and_nodes(self) -> None:
        self._start_dns()
        for _ in range(self.config.nodes):
            self.add_node(wait=False)

    def _start_dns(self) -> None:
        ca = self.control_plane.ca
        assert ca is not None
        cert = ca.issue("dns", common_name=DNS_USER, client=True)
        kubeconfig = write_kubeconfig(
            self.config.root / "dns.kubeconfig",
            server=self.control_plane.server,
            ca_cert=ca.pair.cert,
            client=cert,
            user="dns",
        )
        self.dns = ManagedProcess(
            name="dns",
            log_path=self.control_plane.logs / "dns.log",
            env=self._python_env(),
            argv=[
                sys.executable,
                "-m",
                "ctj_devcluster.dns",
                f"--kubeconfig={kubeconfig}",
                f"--dns-dir={self.dns_dir}",
            ],
        ).start()

    def _grant_dns(self) -> None:
        """RBAC for the DNS publisher (it retries until this exists), as CoreDNS gets."""
        from kubernetes import client

        rbac = client.RbacAuthorizationV1Api(self.api_client())
        rbac.create_cluster_role(
            {
                "metadata": {"name": DNS_USER},
                "rules": [
                    {
                        "apiGroups": [""],
                        "resources": ["pods", "services"],
                        "verbs": ["list", "watch"],
                    }
                ],
            }
        )
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": DNS_USER},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": DNS_USER,
                },
                "subjects": [
                    {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DNS_USER}
                ],
            }
        )

    def _python_env(self) -> dict[str, str]:
        pythonpath = os.pathsep.join(p for p in (str(HACK_DIR), os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": pythonpath}

    def add_node(
        self, name: str | None = None, *, wait: bool = True, **overrides: Any
    ) -> NodeHandle:
        """Starts a node agent (name defaults to node-<n>); waits until it is Ready."""
        index = self._next_index
        self._next_index += 1
        name = name or f"node-{index}"
        cp = self.control_plane
        host, port = cp.server.removeprefix("https://").rsplit(":", 1)
        settings: dict[str, Any] = {
            "cpu": self.config.node_cpu,
            "memory": self.config.node_memory,
            "extended_resources": dict(self.config.node_extended_resources),
            "image_entrypoints": dict(self.config.image_entrypoints),
            **overrides,
        }
        serving = cp.node_serving_cert(name, f"{self.net}.{index}.1")
        assert cp.ca is not None
        node_config = NodeAgentConfig(
            name=name,
            index=index,
            kubeconfig=cp.node_kubeconfig(name),
            root=self.config.root / "nodes" / name,
            dns_dir=self.dns_dir,
            api_host=host,
            api_port=int(port),
            kubelet_version=_kube_version(self.binaries),
            net=self.net,
            shm_root=str(self.shm_root),
            serving_cert=str(serving.cert),
            serving_key=str(serving.key),
            client_ca=str(cp.ca.pair.cert),
            **settings,
        )
        node_config.root.mkdir(parents=True, exist_ok=True)
        self.dns_dir.mkdir(parents=True, exist_ok=True)
        config_path = node_config.root / "agent.json"
        config_path.write_text(node_config.to_json())
        proc = ManagedProcess(
            name=f"node-agent {name}",
            log_path=node_config.root / "agent.log",
            env=self._python_env(),
            argv=[sys.executable, "-m", "ctj_devcluster.node_agent", str(config_path)],
        ).start()
        handle = self.nodes[name] = NodeHandle(name, node_config, proc)
        if wait:
            self.wait_node_ready(name)
        self._write_state()
        return handle

    def wait_node_ready(self, name: str, timeout: float | None = None) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        proc = self.nodes[name].process

        def ready() -> bool:
            proc.check_alive()
            node = core.read_node(name)
            return any(
                c.type == "Ready" and c.status == "True" for c in node.status.conditions or []
            )

        wait_until(
            ready,
            timeout=timeout or self.config.start_timeout,
            what=f"node {name} Ready",
            on_timeout=proc.log_tail,
        )

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """What a container wrote (stdout and stderr, every run): ``kubectl logs`` needs a
        kubelet API that the agents do not serve, so read the node's log file."""
        for handle in self.nodes.values():
            for path in (handle.config.root / "pods").glob(f"{namespace}_{pod}_*/{container}.log"):
                return path.read_text(errors="replace")
        raise FileNotFoundError(f"no log for {namespace}/{pod}/{container}")

    def kill_node(self, name: str) -> None:
        """Loses the machine: SIGKILL to the agent and everything it runs, no goodbye."""
        self.nodes[name].process.kill()

    def restart_node(self, name: str) -> None:
        """Brings a killed or stopped node back (same name and addresses) and waits until it
        is Ready: the machine rebooted. Its pods that were evicted meanwhile are removed;
        the others start again."""
        handle = self.nodes[name]
        if handle.process.alive():
            handle.process.stop(grace=10.0)
        handle.process.start()
        self.wait_node_ready(name)

    def stop_node(self, name: str) -> None:
        """Shuts the agent down (its containers are stopped first); the Node stays."""
        self.nodes[name].process.stop(grace=10.0)

    def _wait_default_service_account(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        wait_until(
            lambda: core.read_namespaced_service_account("default", "default"),
            timeout=self.config.start_timeout,
            what="the default service account",
        )

    def stop(self) -> None:
        for handle in reversed(list(self.nodes.values())):
            handle.process.stop(grace=10.0)
        if self.dns is not None:
            self.dns.stop()
        self.control_plane.stop()
        shutil.rmtree(self.shm_root, ignore_errors=True)
        for claim in self._net_claim:
            claim.close()
        self._net_claim = []

    def _write_state(self) -> None:
        pids = {p.name: p.pid for p in self.control_plane.processes}
        pids.update({h.process.name: h.process.pid for h in self.nodes.values()})
        if self.dns is not None:
            pids["dns"] = self.dns.pid
        state = {
            "kubeconfig": str(self.kubeconfig),
            "server": self.control_plane.server,
            "pids": pids,
            "root": str(self.config.root),
            "pid": os.getpid(),
            "nodes": sorted(self.nodes),
            "started_in_seconds": round(self.started_in, 2),
            "kubectl": str(self.binaries.kubectl),
            "helm": str(self.binaries.helm),
        }
        (self.config.root / "state.json").write_text(json.dumps(state, indent=2) + "\n")


def _kube_version(binaries: Binaries) -> str:
    """The Kubernetes version the binaries are, from their cache directory name."""
    for part in binaries.kube_apiserver.parts:
        if part.startswith("k8s-v"):
            return part.split("-")[1]
    return "v1.34.0"


def _nets_in_use() -> set[str]:
    """The 127.X (X >= 10) /16s some local TCP socket is bound in (a node, a pod, or a
    cluster that does not claim its net as _claim_loopback_net does)."""
    nets: set[str] = set()
    try:
        with open("/proc/net/tcp") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return nets
    for line in lines:
        fields = line.split()
        if len(fields) < 2:
            continue
        address = socket.inet_ntoa(struct.pack("<I", int(fields[1].split(":")[0], 16)))
        first, second = address.split(".")[:2]
        if first == "127" and int(second) >= 10:
            nets.add(f"127.{second}")
    return nets


def _claim_loopback_net(wanted: str = "") -> tuple[str, list[socket.socket]]:
    """A 127.X/16 for the cluster's node and pod addresses, claimed for as long as the
    returned sockets stay open (they close with the process, however it ends).

    The claim is an abstract Unix socket named after the net: binding it is atomic, and
    a second cluster's bind fails until the first one's socket is closed, so two clusters
    starting at once never share addresses (a probe of a port, as before, would race).
    Nets where local TCP sockets already live are skipped. A TCP socket (no
    SO_REUSEADDR) on <net>.1.1:10250 is also held when possible, so a launcher from
    before the claim (it probed that port) keeps away too."""
    in_use = set() if wanted else _nets_in_use()
    candidates = [wanted] if wanted else [f"127.{x}" for x in range(10, 255)]
    for net in candidates:
        if net in in_use:
            continue
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0ctj-devcluster/net/{net}")
        except OSError:
            claim.close()
            if wanted:
                raise RuntimeError(f"loopback net {net} is in use by another cluster") from None
            continue
        claims = [claim]
        legacy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            legacy.bind((f"{net}.1.1", 10250))
            claims.append(legacy)
        except OSError:
            legacy.close()
        return net, claims
    raise RuntimeError("no free 127.X/16 for the cluster's addresses")


ESTABLISHED = '{.status.conditions[?(@.type=="Established")].status}'


def wait_crd_established(kubectl: Callable[..., str], crd: str, timeout: float = 60) -> None:
    """Until the API server serves the CRD's kind; ``kubectl(*args)`` returns stdout. Not
    ``kubectl wait --for=condition=Established``: that fails at once ("conditions accessor
    error: <nil>") on a CRD whose status the API server has not written yet, as it can be
    just after the create."""
    wait_until(
        lambda: kubectl("get", "crd", crd, f"-o=jsonpath={ESTABLISHED}").strip() == "True",
        timeout=timeout,
        what=f"CRD {crd} to be established",
        interval=0.2,
    )
