"""The real Kubeflow PyTorchJob controller (kubeflow/training-operator, built from its Go
module by hack/cluster-binaries.sh) run against a cluster from outside it, the way
``make run`` runs a controller during development: a kubeconfig, no Deployment.

What its Deployment would provide, provided here:

- the PyTorchJob CRD and the ``training-operator`` ClusterRole from the same module
  version, bound to a ServiceAccount whose token is the controller's only credential;
- the namespace (``kubeflow``, as ``MY_POD_NAMESPACE``) holding the Secret its certificate
  rotator fills, and a serving certificate in the directory the webhook server reads
  (in a pod the Secret is mounted there). No ValidatingWebhookConfiguration is installed:
  the API server cannot call a server outside the cluster, and validation is not what is
  under test;
- the init container template (``--pytorch-init-container-template-file``, a ConfigMap
  in a real install): the default waits with ``nslookup``, which asks a DNS server, and
  the local cluster's DNS is hosts files (see dns.py); ``getent hosts`` reads those.

The controller itself is unmodified: it creates the Master/Worker pods and their headless
Services, sets MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK, and writes the job's conditions.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .binaries import find_built
from .ports import retry_on_bind_conflict
from .processes import ManagedProcess, ProcessDied

if TYPE_CHECKING:
    from .cluster import Cluster

NAMESPACE = "kubeflow"
SERVICE_ACCOUNT = "training-operator"
CLUSTER_ROLE = "training-operator"  # the name in the module's rbac/role.yaml
WEBHOOK_SECRET = "training-operator-webhook-cert"
# hard-coded in training-operator's pkg/cert; controller-runtime's default for $TMPDIR=/tmp
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")
INIT_CONTAINER_TEMPLATE = """\
- name: init-pytorch
  image: {{.InitContainerImage}}
  imagePullPolicy: IfNotPresent
  resources:
    limits:
      cpu: 100m
      memory: 20Mi
    requests:
      cpu: 50m
      memory: 10Mi
  command:
  - sh
  - -c
  - >-
    err=1;for i in $(seq {{.MaxTries}}); do if getent hosts {{.MasterAddr}};
    then err=0 && break; fi;echo waiting for master; sleep 2; done; exit $err
"""


class KubeflowError(RuntimeError):
    """The controller is not built, did not start, or stopped answering."""


@dataclass(frozen=True, slots=True)
class KubeflowBuild:
    """What hack/cluster-binaries.sh puts in the training-operator's cache directory."""

    binary: Path
    crd: Path
    cluster_role: Path

    @classmethod
    def find(cls) -> KubeflowBuild:
        """From ``CTJ_KUBEFLOW_BIN_DIR`` or the build script's ``--check``."""
        binary, crd, cluster_role = find_built(
            "CTJ_KUBEFLOW_BIN_DIR", "the Kubeflow training-operator", "bin/training-operator.v1",
            "crds/kubeflow.org_pytorchjobs.yaml", "rbac/role.yaml",
        )  # fmt: skip
        return cls(binary=binary, crd=crd, cluster_role=cluster_role)


def install_crd(cluster: Cluster, build: KubeflowBuild) -> None:
    """The real PyTorchJob CRD (server-side apply: it is larger than the client-side
    last-applied annotation may be)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(build.crd))
    cluster.wait_crd_established("pytorchjobs.kubeflow.org")


def _serving_certificate() -> None:
    """A certificate for the webhook server to load, shared by every run on the machine
    (the directory is hard-coded upstream). Renewed daily (certs.py issues for 7 days):
    the pair is written to a directory of its own and ``serving-certs`` is a symlink
    swapped in one rename, so a controller starting meanwhile never reads a key of one
    pair with the certificate of another."""
    from .certs import CertificateAuthority

    base = CERT_DIR.parent
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        crt = CERT_DIR / "tls.crt"
        if (CERT_DIR / "tls.key").exists() and crt.exists():
            if time.time() - crt.stat().st_mtime < 86400:
                return
        old = CERT_DIR.resolve() if CERT_DIR.is_symlink() else None
        if CERT_DIR.exists() and not CERT_DIR.is_symlink():
            shutil.rmtree(CERT_DIR)  # a plain directory from an older layout
        new = base / f"serving-certs.{os.getpid()}.{int(time.time())}"
        ca = CertificateAuthority(new, common_name="training-operator-ca")
        ca.issue(
            "tls",
            common_name=f"{SERVICE_ACCOUNT}.{NAMESPACE}.svc",
            server=True,
            dns_names=(f"{SERVICE_ACCOUNT}.{NAMESPACE}.svc",),
        )
        for name in ("ca.crt", "ca.key"):
            (new / name).unlink()
        link = base / f".serving-certs.{os.getpid()}"
        link.unlink(missing_ok=True)
        link.symlink_to(new.name)
        os.replace(link, CERT_DIR)
        if old is not None and old != new:
            shutil.rmtree(old, ignore_errors=True)


class KubeflowController:
    """``install()`` the CRD and RBAC, ``start()`` the controller, ``stop()`` it."""

    def __init__(self, cluster: Cluster, root: Path, build: KubeflowBuild | None = None) -> None:
        self.cluster = cluster
        self.root = root
        self.build = build or KubeflowBuild.find()
        self.process: ManagedProcess | None = None
        self.metrics_port = 0
        self.probe_port = 0

    @property
    def log_path(self) -> Path:
        return self.root / "training-operator.log"

    def install(self) -> None:
        install_crd(self.cluster, self.build)
        kubectl = self.cluster.kubectl
        kubectl("create", "namespace", NAMESPACE, check=False)
        kubectl("-n", NAMESPACE, "create", "serviceaccount", SERVICE_ACCOUNT, check=False)
        kubectl("apply", "-f", str(self.build.cluster_role))
        kubectl(
            "create",
            "clusterrolebinding",
            CLUSTER_ROLE,
            f"--clusterrole={CLUSTER_ROLE}",
            f"--serviceaccount={NAMESPACE}:{SERVICE_ACCOUNT}",
            check=False,
        )
        kubectl("-n", NAMESPACE, "create", "secret", "generic", WEBHOOK_SECRET, check=False)

    def start(self, timeout: float = 60.0) -> KubeflowController:
        self.root.mkdir(parents=True, exist_ok=True)
        _serving_certificate()
        kubeconfig = self.cluster.service_account_kubeconfig(
            NAMESPACE, SERVICE_ACCOUNT, self.root / "kubeconfig", duration="24h"
        )
        template = self.root / "init-container.yaml"
        template.write_text(INIT_CONTAINER_TEMPLATE)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "TMPDIR": "/tmp",
            "KUBECONFIG": str(kubeconfig),
            "MY_POD_NAMESPACE": NAMESPACE,
        }

        def launch(ports: tuple[int, ...]) -> ManagedProcess:
            argv = [
                str(self.build.binary),
                "--enable-scheme=pytorchjob",
                f"--metrics-bind-address=127.0.0.1:{ports[0]}",
                f"--health-probe-bind-address=127.0.0.1:{ports[1]}",
                f"--webhook-server-port={ports[2]}",
                f"--pytorch-init-container-template-file={template}",
                "--zap-log-level=info",
            ]
            return ManagedProcess("training-operator", argv, self.log_path, env=env).start()

        self.process, (self.metrics_port, self.probe_port, _) = retry_on_bind_conflict(
            launch, ports=3, what="training-operator", timeout=timeout
        )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """/readyz answers 200 once the certificates are in place and the webhook server
        listens, after which the PyTorchJob controller is registered."""
        assert self.process is not None
        try:
            self.process.wait_ready(f"http://127.0.0.1:{self.probe_port}/readyz", timeout)
        except (ProcessDied, TimeoutError) as exc:
            raise KubeflowError(str(exc)) from exc

    def log_tail(self, lines: int = 40) -> str:
        if self.process is None and not self.log_path.exists():
            return "[training-operator: not started]"
        return ManagedProcess("training-operator", ["-"], self.log_path).log_tail(lines)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            return str(r.read().decode())

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace=10.0)
            self.process = None
