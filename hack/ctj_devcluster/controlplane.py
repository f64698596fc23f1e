"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback.

Started the way controller-runtime's envtest starts them (a private data dir, free ports,
readiness polled, not assumed; a component that loses its port to another process before
binding it is restarted on new ones, see ports.py), plus what envtest leaves out and a
node-loss test needs: the controller manager (node lifecycle, taint eviction, garbage
collector, service accounts and their tokens, endpoints) and the scheduler. All traffic
is TLS with client certificates, and the API server authorizes with Node,RBAC, so
permission mistakes in our manifests fail here as they would on a real cluster.
"""

from __future__ import annotations

import ipaddress
import json
import ssl
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .binaries import Binaries
from .certs import CertificateAuthority, CertPair, write_service_account_keys
from .kubeconfig import write_kubeconfig
from .ports import ServerStart
from .processes import ManagedProcess, wait_until

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
PORT_ATTEMPTS = 5
"""How many times a component is started on new ports after losing its port to another
process between our choosing it and its binding it."""

AUDIT_POLICY = """\
# Written by ctj_devcluster (ClusterConfig.audit_log): every request, at level Metadata
# (who did what to which object, and the response code; no bodies), logged once it is
# complete. Long-running requests (watch, exec, logs -f) also log ResponseStarted.
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
"""


@dataclass(kw_only=True)
class ControlPlaneConfig:
    """How to run the control plane. Durations are in seconds."""

    root: Path
    """Directory for data, certificates, kubeconfigs and logs (created; not deleted)."""
    node_monitor_grace_period: float = 10.0
    """How long a node may miss heartbeats before it is NotReady (kube's default: 50s)."""
    node_monitor_period: float = 1.0
    """How often the node lifecycle controller checks nodes (kube's default: 5s)."""
    service_cluster_ip_range: str = "10.0.0.0/24"
    start_timeout: float = 90.0
    """Deadline for each component to become healthy."""
    audit_log: bool = False
    """Log every API request (level Metadata, stage ResponseComplete, JSON lines) to
    ``root/audit.log``; read it with ctj_devcluster.audit."""
    extra_apiserver_args: tuple[str, ...] = ()
    extra_controller_manager_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.node_monitor_period <= 0:
            raise ValueError("node_monitor_period must be positive")
        if self.node_monitor_grace_period < 2 * self.node_monitor_period:
            raise ValueError("node_monitor_grace_period must be at least 2 node_monitor_periods")
        if self.start_timeout <= 0:
            raise ValueError("start_timeout must be positive")


def _duration(seconds: float) -> str:
    return f"{int(seconds * 1000)}ms"


@dataclass
class ControlPlane:
    """A running control plane; ``start()`` returns once every component is healthy."""

    config: ControlPlaneConfig
    binaries: Binaries
    processes: list[ManagedProcess] = field(default_factory=list, init=False)
    ca: CertificateAuthority | None = field(default=None, init=False)
    server: str = field(default="", init=False)
    admin_kubeconfig: Path = field(default=Path(), init=False)
    admin_cert: CertPair | None = field(default=None, init=False)

    @property
    def pki(self) -> Path:
        return self.config.root / "pki"

    @property
    def logs(self) -> Path:
        return self.config.root / "logs"

    @property
    def audit_log_path(self) -> Path:
        """The API server's audit log (written only with ``config.audit_log``)."""
        return self.config.root / "audit.log"

    def _audit_args(self) -> list[str]:
        if not self.config.audit_log:
            return []
        policy = self.config.root / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log_path}",
            "--audit-log-format=json",
            # blocking (the log backend's default, said explicitly): each event is written,
            # unbuffered, in the request's own handler, not by a batching goroutine later
            "--audit-log-mode=blocking",
            "--audit-log-maxsize=100000",  # MB before rotating: never, in a test
            "--audit-log-maxbackup=1",
        ]

    def start(self, with_apiserver: Callable[[], None] | None = None) -> ControlPlane:
        """Starts every component; ``with_apiserver`` runs as soon as the API server
        listens on its port (``self.server`` is final), before it is ready (the cluster
        starts its node agents and DNS there: they retry until it answers, and their
        start-up overlaps the API server's)."""
        try:
            self._start(with_apiserver)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, with_apiserver: Callable[[], None] | None) -> None:
        root = self.config.root
        root.mkdir(parents=True, exist_ok=True)
        ca = self.ca = CertificateAuthority(self.pki)
        sa = write_service_account_keys(self.pki)
        loopback = ("127.0.0.1",)
        service_ip = _first_service_ip(self.config.service_cluster_ip_range)

        etcd_server = ca.issue(
            "etcd-server",
            common_name="etcd",
            server=True,
            client=True,
            dns_names=("localhost",),
            ips=loopback,
        )
        etcd_client_cert = ca.issue(
            "apiserver-etcd-client", common_name="kube-apiserver", client=True
        )

        def etcd_argv(ports: tuple[int, ...]) -> list[str]:
            client, peer = ports
            return [
                str(self.binaries.etcd),
                "--name=default",
                f"--data-dir={root / 'etcd'}",  # not created when a listener fails
                f"--listen-client-urls=https://127.0.0.1:{client}",
                f"--advertise-client-urls=https://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                f"--cert-file={etcd_server.cert}",
                f"--key-file={etcd_server.key}",
                f"--trusted-ca-file={ca.pair.cert}",
                "--client-cert-auth",
                "--unsafe-no-fsync",  # test data: speed over durability, as envtest does
                "--log-level=warn",
            ]

        # Bound before the API server starts: it is given etcd's final address.
        etcd_client, _ = self._bound(self._start_on_free_ports("etcd", etcd_argv, ports=2))
        etcd_url = f"https://127.0.0.1:{etcd_client}"

        serving = ca.issue(
            "apiserver",
            common_name="kube-apiserver",
            server=True,
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ips=("127.0.0.1", service_ip),
        )
        kubelet_client = ca.issue(
            "apiserver-kubelet-client", common_name="kube-apiserver-kubelet-client", client=True
        )
        self.admin_cert = ca.issue(
            "admin", common_name="ctj-admin", orgs=("system:masters",), client=True
        )
        admin_cert = self.admin_cert
        audit_args = self._audit_args()

        def apiserver_argv(ports: tuple[int, ...]) -> list[str]:
            (port,) = ports
            self.server = f"https://127.0.0.1:{port}"
            self.admin_kubeconfig = write_kubeconfig(
                root / "admin.kubeconfig",
                server=self.server,
                ca_cert=ca.pair.cert,
                client=admin_cert,
                user="admin",
            )
            return [
                str(self.binaries.kube_apiserver),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={ca.pair.cert}",
                f"--etcd-servers={etcd_url}",
                f"--etcd-cafile={ca.pair.cert}",
                f"--etcd-certfile={etcd_client_cert.cert}",
                f"--etcd-keyfile={etcd_client_cert.key}",
                f"--service-cluster-ip-range={self.config.service_cluster_ip_range}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                "--authorization-mode=Node,RBAC",
                # kubectl logs: reach each node agent's kubelet API on its InternalIP, with TLS
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-certificate-authority={ca.pair.cert}",
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                "--profiling=false",
                *audit_args,
                *self.config.extra_apiserver_args,
            ]

        # Bound (it listens within a second or two, long before it is ready) before
        # with_apiserver: what that starts is given the server's final address.
        apiserver_start = self._start_on_free_ports("kube-apiserver", apiserver_argv)
        self._bound(apiserver_start)
        apiserver = apiserver_start.process
        assert apiserver is not None
        if with_apiserver is not None:
            with_apiserver()
        ctx = ssl.create_default_context(cafile=str(ca.pair.cert))
        ctx.load_cert_chain(str(self.admin_cert.cert), str(self.admin_cert.key))
        self._wait_healthy(apiserver, f"{self.server}/readyz", ctx)

        kcm_cert = ca.issue(
            "kube-controller-manager", client=True, common_name="system:kube-controller-manager"
        )
        kcm_kubeconfig = self._component_kubeconfig("kube-controller-manager", kcm_cert)
        kcm_start = self._start_on_free_ports(
            "kube-controller-manager",
            lambda ports: [
                str(self.binaries.kube_controller_manager),
                f"--kubeconfig={kcm_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports[0]}",
                f"--cert-dir={root / 'kube-controller-manager'}",
                "--leader-elect=false",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa.key}",
                f"--root-ca-file={ca.pair.cert}",
                f"--cluster-signing-cert-file={ca.pair.cert}",
                f"--cluster-signing-key-file={ca.pair.key}",
                f"--service-cluster-ip-range={self.config.service_cluster_ip_range}",
                f"--node-monitor-period={_duration(self.config.node_monitor_period)}",
                f"--node-monitor-grace-period={_duration(self.config.node_monitor_grace_period)}",
                "--kube-api-qps=100",
                "--kube-api-burst=200",
                *self.config.extra_controller_manager_args,
            ],
        )
        scheduler_cert = ca.issue(
            "kube-scheduler", client=True, common_name="system:kube-scheduler"
        )
        scheduler_kubeconfig = self._component_kubeconfig("kube-scheduler", scheduler_cert)
        scheduler_start = self._start_on_free_ports(
            "kube-scheduler",
            lambda ports: [
                str(self.binaries.kube_scheduler),
                f"--kubeconfig={scheduler_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports[0]}",
                f"--cert-dir={root / 'kube-scheduler'}",
                "--leader-elect=false",
            ],
        )
        # Their self-signed serving certificates prove nothing, but the port is bound by
        # our own process (ServerStart checks), so whatever answers there is ours.
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        for start in (kcm_start, scheduler_start):
            (port,) = self._bound(start)
            assert start.process is not None
            self._wait_healthy(start.process, f"https://127.0.0.1:{port}/healthz", insecure)

    def _component_kubeconfig(self, name: str, cert: CertPair) -> Path:
        assert self.ca is not None
        return write_kubeconfig(
            self.config.root / f"{name}.kubeconfig",
            server=self.server,
            ca_cert=self.ca.pair.cert,
            client=cert,
            user=name,
        )

    def node_kubeconfig(self, node_name: str) -> Path:
        """A kubeconfig with the node's own identity (system:node:<name> in system:nodes),
        so the Node authorizer and NodeRestriction limit the agent as they limit a kubelet."""
        assert self.ca is not None
        cert = self.ca.issue(
            f"node-{node_name}",
            client=True,
            common_name=f"system:node:{node_name}",
            orgs=("system:nodes",),
        )
        return write_kubeconfig(
            self.config.root / "nodes" / node_name / "kubeconfig",
            server=self.server,
            ca_cert=self.ca.pair.cert,
            client=cert,
            user=f"node-{node_name}",
        )

    def node_serving_cert(self, node_name: str, node_ip: str) -> CertPair:
        """The serving certificate of a node's kubelet API (the API server verifies it)."""
        assert self.ca is not None
        return self.ca.issue(
            f"node-{node_name}-serving",
            common_name=f"system:node:{node_name}",
            server=True,
            dns_names=(node_name,),
            ips=(node_ip,),
        )

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name=name, argv=argv, log_path=self.logs / f"{name}.log").start()
        self.processes.append(proc)
        return proc

    def _start_on_free_ports(
        self, name: str, argv: Callable[[tuple[int, ...]], list[str]], ports: int = 1
    ) -> ServerStart[ManagedProcess]:
        """Launches ``name`` on fresh ports (returns at once; ``_bound`` waits). Each
        attempt is in ``self.processes`` while it runs, so ``stop()`` reaches it; an
        attempt that lost its port is stopped and replaced there."""
        attempts: list[ManagedProcess] = []

        def launch(chosen: tuple[int, ...]) -> ManagedProcess:
            for old in attempts:
                if old in self.processes:
                    self.processes.remove(old)
            attempts[:] = [self._spawn(name, argv(chosen))]
            return attempts[0]

        return ServerStart(
            launch,
            ports=ports,
            what=name,
            attempts=PORT_ATTEMPTS,
            timeout=self.config.start_timeout,
        ).start()

    def _bound(self, start: ServerStart[ManagedProcess]) -> tuple[int, ...]:
        """The ports ``start``'s component listens on, once it does."""
        return start.wait_bound()[1]

    def _wait_healthy(self, proc: ManagedProcess, url: str, ctx: ssl.SSLContext) -> None:
        def healthy() -> bool:
            proc.check_alive()
            try:
                with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        wait_until(
            healthy,
            timeout=self.config.start_timeout,
            what=f"{proc.name} at {url}",
            interval=0.1,
            on_timeout=proc.log_tail,
        )

    def check_alive(self) -> None:
        for proc in self.processes:
            proc.check_alive()

    def stop(self) -> None:
        """Stops the components in reverse order of start; safe to call twice."""
        for proc in reversed(self.processes):
            proc.stop(grace=5.0)
        self.processes.clear()

    def describe(self) -> dict[str, object]:
        return {
            "server": self.server,
            "kubeconfig": str(self.admin_kubeconfig),
            "pids": {p.name: p.pid for p in self.processes},
        }

    def __repr__(self) -> str:
        return f"ControlPlane({json.dumps(self.describe())})"


def _first_service_ip(cidr: str) -> str:
    return str(next(ipaddress.ip_network(cidr).hosts()))
