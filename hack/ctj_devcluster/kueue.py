"""The real Kueue (sigs.k8s.io/kueue, its manager built from its Go module by
hack/cluster-binaries.sh) run against a cluster from outside it, as kubeflow.py runs
Kubeflow's controller: a kubeconfig, no Deployment.

What its Deployment would provide, provided here:

- its CRDs from the same module version (server-side apply: the Workload CRD is 1.4 MB);
- a Configuration with Kueue's internal certificate management off (its rotator waits for
  a Secret mounted into a pod, and a process outside a cluster would wait for ever), the
  webhook server's certificate in a directory of the run's own, and the metrics server's
  at the path Kueue reads it from whatever the configuration says
  (``/etc/kueue/metrics/certs``). No webhook configuration is installed: the API server
  cannot call a server outside the cluster, and Kueue's defaulting is not under test (the
  operator writes every Workload field Kueue reads);
- the pods-ready wait left on, as in a default install (the operator says PodsReady);
  ``VisibilityOnDemand`` off (its server wants certificates of its own).

The manager itself is unmodified: its scheduler admits, preempts and requeues Workloads.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from .binaries import find_built
from .certs import CertificateAuthority
from .ports import retry_on_bind_conflict
from .processes import ManagedProcess, ProcessDied

if TYPE_CHECKING:
    from .cluster import Cluster

METRICS_CERTS = Path("/etc/kueue/metrics/certs")  # hard-coded in cmd/kueue/main.go


class KueueError(RuntimeError):
    """Kueue is not built, did not start, or stopped answering."""


@dataclass(frozen=True, slots=True)
class KueueBuild:
    """What hack/cluster-binaries.sh puts in Kueue's cache directory."""

    binary: Path
    crds: Path
    manifests: Path
    """Kueue's whole install (config/default rendered: a release's manifests.yaml)."""

    @classmethod
    def find(cls) -> KueueBuild:
        """From ``CTJ_KUEUE_BIN_DIR`` or the build script's ``--check``."""
        binary, crds, manifests = find_built(
            "CTJ_KUEUE_BIN_DIR", "Kueue", "bin/kueue", "crds", "manifests.yaml"
        )
        return cls(binary, crds, manifests)


def install_crds(cluster: Cluster, build: KueueBuild) -> None:
    """Kueue's CRDs (server-side apply: the Workload CRD is larger than the client-side
    last-applied annotation may be)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(build.crds))
    for plural in ("workloads", "clusterqueues", "localqueues", "resourceflavors",
                   "workloadpriorityclasses"):  # fmt: skip
        cluster.wait_crd_established(f"{plural}.kueue.x-k8s.io")


def _metrics_certificate() -> None:
    """A pair at the path Kueue reads it from (shared by every run on the machine, made
    once under a lock; its server is off, but the manager loads the files)."""
    METRICS_CERTS.parent.mkdir(parents=True, exist_ok=True)
    with open(METRICS_CERTS.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (METRICS_CERTS / "tls.crt").exists() and (METRICS_CERTS / "tls.key").exists():
            if time.time() - (METRICS_CERTS / "tls.crt").stat().st_mtime < 86400:
                return
        _issue(METRICS_CERTS, "kueue-metrics")


def _issue(directory: Path, name: str) -> None:
    """``directory``/tls.crt and tls.key, for ``name`` on loopback."""
    ca = CertificateAuthority(directory, common_name=f"{name}-ca")
    pair = ca.issue("serving", common_name=name, server=True, dns_names=("localhost",),
                    ips=("127.0.0.1",))  # fmt: skip
    os.replace(pair.cert, directory / "tls.crt")
    os.replace(pair.key, directory / "tls.key")
    for leftover in ("ca.crt", "ca.key"):
        (directory / leftover).unlink(missing_ok=True)


class KueueController:
    """``install()`` the CRDs, ``start()`` the manager, ``stop()`` it."""

    def __init__(self, cluster: Cluster, root: Path, build: KueueBuild | None = None) -> None:
        self.cluster = cluster
        self.root = root
        self.build = build or KueueBuild.find()
        self.process: ManagedProcess | None = None
        self.probe_port = 0

    @property
    def log_path(self) -> Path:
        return self.root / "kueue.log"

    def install(self) -> None:
        install_crds(self.cluster, self.build)

    def _config(self, webhook_port: int, probe_port: int) -> Path:
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{probe_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {
                "host": "127.0.0.1",
                "port": webhook_port,
                "certDir": str(self.root / "webhook-certs"),
            },  # fmt: skip
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": ["batch/job"]},
            "featureGates": {"VisibilityOnDemand": False},
        }
        path = self.root / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self, timeout: float = 90.0) -> KueueController:
        self.root.mkdir(parents=True, exist_ok=True)
        _issue(self.root / "webhook-certs", "kueue-webhook")
        _metrics_certificate()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "TMPDIR": str(self.root),
            "KUBECONFIG": str(self.cluster.kubeconfig),
        }

        def launch(ports: tuple[int, ...]) -> ManagedProcess:
            config = self._config(webhook_port=ports[0], probe_port=ports[1])
            argv = [str(self.build.binary), f"--config={config}",
                    f"--kubeconfig={self.cluster.kubeconfig}", "--zap-log-level=2"]  # fmt: skip
            return ManagedProcess("kueue", argv, self.log_path, env=env).start()

        self.process, (_, self.probe_port) = retry_on_bind_conflict(
            launch, ports=2, what="kueue", timeout=timeout
        )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.process is not None
        try:
            self.process.wait_ready(f"http://127.0.0.1:{self.probe_port}/readyz", timeout)
        except (ProcessDied, TimeoutError) as exc:
            raise KueueError(str(exc)) from exc

    def log_tail(self, lines: int = 40) -> str:
        if self.process is None and not self.log_path.exists():
            return "[kueue: not started]"
        return ManagedProcess("kueue", ["-"], self.log_path).log_tail(lines)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace=10.0)
            self.process = None
