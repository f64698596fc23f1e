"""Installing ctj's stack on a cluster and watching a job: thin adapters over kubectl, helm
and the Kubernetes API, with every wait a condition and a deadline."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from ctj_contract import GROUP, LABEL_ATTEMPT, LABEL_JOB, LABEL_RANK, PLURAL, VERSION
from ctj_devcluster.binaries import built_dirs
from ctj_devcluster.cluster import wait_crd_established
from ctj_devcluster.processes import wait_until
from kubernetes import client, config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ctj"
EXAMPLE_JOB = ROOT / "examples" / "job.yaml"
SEAWEEDFS_MANIFEST = ROOT / "deploy" / "seaweedfs" / "seaweedfs.yaml"
KUBEFLOW_MANIFEST = ROOT / "deploy" / "kubeflow" / "training-operator.yaml"
S3_NAMESPACE = "seaweedfs"
KUBEFLOW_NAMESPACE = "kubeflow"
KUBEFLOW_WEBHOOK = "validator.training-operator.kubeflow.org"
# how the Kubeflow controller labels its pods (backend pytorchjob), and the container name
# a PyTorchJob requires
KF_REPLICA_TYPE = "training.kubeflow.org/replica-type"
KF_TRAINER = "pytorch"
OPERATOR_NAMESPACE = "ctj-system"
S3_ENDPOINT = "http://seaweedfs.seaweedfs:8333"  # the example job's, in-cluster
RESTART_TIMEOUT = 420.0  # node-monitor grace + teardown + scheduling + torch's start
CONTROL_PLANE_LABEL = "node-role.kubernetes.io/control-plane"
CONTROL_PLANE_TOLERATION = {
    "key": CONTROL_PLANE_LABEL,
    "operator": "Exists",
    "effect": "NoSchedule",
}


def _required(env: dict[str, str], name: str, hint: str) -> str:
    value = env.get(name, "")
    if not value:
        raise ValueError(f"{name} is not set: {hint}")
    return value


@dataclass(frozen=True)
class Images:
    """Our images as the nodes know them (hack/containers/images.sh prints these names)."""

    operator: str
    trainer: str
    seaweedfs: str
    kubeflow: str = ""  # Kubeflow's controller (deploy/kubeflow); "": the cluster's own, if any

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Images:
        env = dict(os.environ if env is None else env)
        hint = "build them with hack/containers/images.sh (it prints CTJ_*_IMAGE=...)"
        return cls(
            operator=_required(env, "CTJ_OPERATOR_IMAGE", hint),
            trainer=_required(env, "CTJ_TRAINER_IMAGE", hint),
            seaweedfs=_required(env, "CTJ_SEAWEEDFS_IMAGE", hint),
            kubeflow=env.get("CTJ_KUBEFLOW_IMAGE", ""),
        )


def _repo_tag(image: str) -> tuple[str, str]:
    repo, _, tag = image.rpartition(":")
    if not repo or "/" in tag:
        raise ValueError(f"image {image!r} has no tag: give repository:tag")
    return repo, tag


@dataclass(frozen=True)
class Tools:
    kubectl: str
    helm: str

    @classmethod
    def find(cls) -> Tools:
        """kubectl and helm from PATH, else the ones hack/cluster-binaries.sh built."""
        dirs = built_dirs()
        found = {}
        for name, key in (("kubectl", "CTJ_K8S_BIN_DIR"), ("helm", "CTJ_HELM_BIN_DIR")):
            path = shutil.which(name) or str(Path(dirs.get(key, "")) / name)
            if not os.access(path, os.X_OK):
                raise FileNotFoundError(f"{name} not found: run hack/cluster-binaries.sh")
            found[name] = path
        return cls(**found)


@dataclass(frozen=True)
class NodeControl:
    """How to stop and start a node, as shell command templates with ``{node}``: on kind
    ``docker kill {node}`` and ``docker start {node}`` (CTJ_E2E_NODE_STOP/START)."""

    stop: str
    start: str

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> NodeControl | None:
        env = dict(os.environ if env is None else env)
        stop, start = env.get("CTJ_E2E_NODE_STOP", ""), env.get("CTJ_E2E_NODE_START", "")
        return cls(stop, start) if stop and start else None

    def _run(self, template: str, node: str) -> None:
        command = template.format(node=shlex.quote(node))
        subprocess.run(command, shell=True, check=True, stdout=subprocess.DEVNULL)

    def stop_node(self, node: str) -> None:
        self._run(self.stop, node)

    def start_node(self, node: str) -> None:
        self._run(self.start, node)


@dataclass(frozen=True)
class S3Credentials:
    """Random keys for the in-cluster S3 server; they live only in two Secrets."""

    access_key: str = field(default_factory=lambda: "ctj" + secrets.token_hex(8), repr=False)
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20), repr=False)

    def identities_json(self) -> str:
        identity = {
            "name": "ctj",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        return json.dumps({"identities": [identity]})


def trainer_log_events(text: str) -> list[dict[str, Any]]:
    """The JSON event lines of a trainer's log (examples/train_fsdp.py prints one per
    event); other lines, and a line still being written, are skipped."""
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


class Stack:
    """One cluster: install, apply, read back. ``log`` gets one line per step."""

    def __init__(
        self,
        kubeconfig: Path,
        images: Images,
        tools: Tools | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.images = images
        self.tools = tools or Tools.find()
        self.log = log
        self.api_client = config.new_client_from_config(str(kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)

    # --- commands -------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return self._run([self.tools.kubectl, *args], stdin)

    def can_i(self, account: str, *verb_resource: str) -> bool:
        """``kubectl auth can-i ... --as=<account>`` in every namespace (exit 0 yes, 1 no)."""
        proc = subprocess.run(
            [self.tools.kubectl, "auth", "can-i", *verb_resource, f"--as={account}", "-A"],
            text=True, capture_output=True, env=self._env(), check=False,
        )  # fmt: skip
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"kubectl auth can-i failed: {proc.stderr.strip()}")
        return proc.returncode == 0

    def helm(self, *args: str) -> str:
        return self._run([self.tools.helm, *args], None)

    def _run(self, argv: list[str], stdin: str | None) -> str:
        proc = subprocess.run(
            argv, input=stdin, text=True, capture_output=True, env=self._env(), check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{Path(argv[0]).name} {' '.join(argv[1:4])}... failed ({proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}"
            )
        return proc.stdout

    def apply(self, objects: list[dict[str, Any]], namespace: str | None = None) -> None:
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        self.kubectl(*args, stdin=yaml.safe_dump_all(objects))

    # --- installing -----------------------------------------------------------------

    def install_operator(
        self, namespace: str = OPERATOR_NAMESPACE, release: str = "ctj", control_plane: bool = False
    ) -> None:
        """The chart, with our images, as a user installs it; waits until it is Ready.
        ``control_plane``: run the operator on the control-plane node (a test cluster's
        way to lose a worker without losing the operator too)."""
        repo, tag = _repo_tag(self.images.operator)
        sidecar_repo, sidecar_tag = _repo_tag(self.images.trainer)
        placement: list[str] = []
        if control_plane:
            placement = [
                "--set-json", f"tolerations=[{json.dumps(CONTROL_PLANE_TOLERATION)}]",
                "--set-json", f"nodeSelector={json.dumps({CONTROL_PLANE_LABEL: ''})}",
            ]  # fmt: skip
        self.log(f"helm install {release} charts/ctj (operator {self.images.operator})")
        self.helm(
            "upgrade", "--install", release, str(CHART), "-n", namespace, "--create-namespace",
            "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
            "--set", f"sidecarImage.repository={sidecar_repo}",
            "--set", f"sidecarImage.tag={sidecar_tag}",
            *placement, "--wait", "--timeout", "5m",
        )  # fmt: skip

    def install_s3(self, credentials: S3Credentials) -> None:
        """deploy/seaweedfs with our image and a Secret of the given keys; waits until the
        gateway can be reached."""
        self.log(f"S3 server: deploy/seaweedfs/seaweedfs.yaml ({self.images.seaweedfs})")
        objects = [o for o in yaml.safe_load_all(SEAWEEDFS_MANIFEST.read_text()) if o]
        identities = credentials.identities_json()
        for obj in objects:
            if obj["kind"] == "Deployment":
                template = obj["spec"]["template"]
                for c in template["spec"]["containers"]:
                    c["image"] = self.images.seaweedfs
                # the server reads its identities at start: new keys, a new pod
                digest = hashlib.sha256(identities.encode()).hexdigest()[:16]
                template["metadata"].setdefault("annotations", {})["ctj.dev/identities-sha256"] = (
                    digest
                )
        namespace = next(o for o in objects if o["kind"] == "Namespace")
        self.apply([namespace])
        self.apply([self._secret(S3_NAMESPACE, "seaweedfs-s3-identities",
                                 {"s3.json": identities})])  # fmt: skip
        self.apply([o for o in objects if o["kind"] != "Namespace"])
        self.kubectl("-n", S3_NAMESPACE, "rollout", "status", "deployment/seaweedfs",
                     "--timeout=180s")  # fmt: skip

    def serves_pytorchjobs(self) -> bool:
        names = self.kubectl("api-resources", "--api-group=kubeflow.org", "-o", "name")
        return "pytorchjobs.kubeflow.org" in names.split()

    def install_kubeflow(self, control_plane: bool = False) -> None:
        """Kubeflow's PyTorchJob controller as deploy/kubeflow lays it out, with our image
        of it and the CRD and ClusterRole of the module it is built from; waits until its
        validating webhook answers (the controller puts its certificates in place)."""
        from ctj_devcluster.kubeflow import KubeflowBuild

        build = KubeflowBuild.find()
        self.log(f"Kubeflow's controller: deploy/kubeflow ({self.images.kubeflow})")
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(build.crd))
        self.kubectl("apply", "-f", str(build.cluster_role))
        objects = [o for o in yaml.safe_load_all(KUBEFLOW_MANIFEST.read_text()) if o]
        for obj in objects:
            if obj["kind"] == "Deployment":
                pod = obj["spec"]["template"]["spec"]
                (container,) = pod["containers"]
                container["image"] = self.images.kubeflow
                # the workers' init container runs an image the nodes have: the trainer's
                container["args"] = [
                    f"--pytorch-init-container-image={self.images.trainer}"
                    if a.startswith("--pytorch-init-container-image=") else a
                    for a in container["args"]
                ]  # fmt: skip
                if control_plane:
                    pod["tolerations"] = [CONTROL_PLANE_TOLERATION]
                    pod["nodeSelector"] = {CONTROL_PLANE_LABEL: ""}
        self.apply(objects)
        wait_crd_established(self.kubectl, "pytorchjobs.kubeflow.org")
        self.kubectl("-n", KUBEFLOW_NAMESPACE, "rollout", "status",
                     "deployment/training-operator", "--timeout=300s")  # fmt: skip
        jsonpath = "{.webhooks[0].clientConfig.caBundle}"

        def ca_injected() -> bool:
            got = self.kubectl("get", "validatingwebhookconfiguration", KUBEFLOW_WEBHOOK,
                               f"-o=jsonpath={jsonpath}")  # fmt: skip
            return bool(got.strip())

        self.wait(ca_injected, "the PyTorchJob webhook's CA in place", 120)

    @staticmethod
    def _secret(namespace: str, name: str, data: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "stringData": data,
        }

    def job_namespace(self, namespace: str, credentials: S3Credentials) -> None:
        """A namespace for jobs, with the example's ``s3-credentials`` Secret."""
        self.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}])
        self.apply([self._secret(namespace, "s3-credentials", {
            "AWS_ACCESS_KEY_ID": credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": credentials.secret_key,
        })])  # fmt: skip

    def example_job(self, name: str = "demo", backend: str = "pods", **env: str) -> dict[str, Any]:
        """examples/job.yaml with our trainer image (and ``env`` set in the trainer), named
        ``name``, run by ``backend``."""
        job: dict[str, Any] = yaml.safe_load(EXAMPLE_JOB.read_text())
        job["metadata"]["name"] = name
        job["spec"]["backend"] = backend
        trainer = job["spec"]["template"]["spec"]["containers"][0]
        trainer["image"] = self.images.trainer
        trainer["imagePullPolicy"] = "IfNotPresent"
        have = {e["name"]: e for e in trainer.setdefault("env", [])}
        for name, value in env.items():
            have[name] = {"name": name, "value": value}
        trainer["env"] = list(have.values())
        return job

    def apply_job(self, namespace: str, job: dict[str, Any]) -> None:
        self.log(f"kubectl apply -f examples/job.yaml -n {namespace} "
                 f"(name {job['metadata']['name']}, backend {job['spec']['backend']})")  # fmt: skip
        self.apply([job], namespace)

    # --- reading back ---------------------------------------------------------------

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
        assert isinstance(obj, dict)
        return obj

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return dict(self.job(namespace, name).get("status") or {})

    def pods(self, namespace: str, name: str) -> list[Any]:
        selector = f"{LABEL_JOB}={name}"
        return list(self.core.list_namespaced_pod(namespace, label_selector=selector).items)

    def attempt_pods(self, namespace: str, name: str, attempt: int) -> list[Any]:
        return [
            p
            for p in self.pods(namespace, name)
            if p.metadata.labels.get(LABEL_ATTEMPT) == str(attempt)
        ]

    def running(self, namespace: str, name: str, world: int) -> dict[str, Any] | None:
        """The status once an attempt runs at ``world`` with all its pods Running."""
        st = self.status(namespace, name)
        if st.get("phase") != "Running" or st.get("worldSize") != world:
            return None
        pods = self.attempt_pods(namespace, name, int(st.get("attempt", -1)))
        ok = len(pods) == world and all(p.status.phase == "Running" for p in pods)
        return st if ok else None

    def trainer_events(self, namespace: str, pod: str) -> list[dict[str, Any]]:
        """The JSON lines examples/train_fsdp.py printed (none if the pod has no log yet),
        from its trainer container (named ``pytorch`` in a PyTorchJob's pods)."""
        for container in ("trainer", KF_TRAINER):
            try:
                text = self.core.read_namespaced_pod_log(pod, namespace, container=container)
            except client.ApiException:
                continue
            return trainer_log_events(text)
        return []

    def wait_running(self, namespace: str, name: str, world: int, after: int) -> dict[str, Any]:
        """The status once an attempt later than ``after`` runs at ``world``."""

        def later() -> dict[str, Any] | None:
            st = self.running(namespace, name, world)
            return st if st and int(st["attempt"]) > after else None

        st: dict[str, Any] = self.wait(
            later, f"the job to run at world size {world}", RESTART_TIMEOUT,
            lambda: self.describe(namespace, name),
        )  # fmt: skip
        return st

    def restored(
        self, namespace: str, name: str, attempt: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Rank 0's ``restored`` event in ``attempt`` and its first step after it (the
        example logs from rank 0 only; every rank loads the step rank 0 reports)."""

        def seen() -> tuple[dict[str, Any], dict[str, Any]] | None:
            pods = [
                p
                for p in self.attempt_pods(namespace, name, attempt)
                if p.metadata.labels.get(LABEL_RANK) == "0"
                or p.metadata.labels.get(KF_REPLICA_TYPE) == "master"
            ]
            if not pods:
                return None
            events = self.trainer_events(namespace, pods[0].metadata.name)
            restored = [e for e in events if e["event"] == "restored"]
            steps = [e for e in events if e["event"] == "step"]
            return (restored[0], steps[0]) if restored and steps else None

        found: tuple[dict[str, Any], dict[str, Any]] = self.wait(
            seen, f"attempt {attempt} to restore and train", 240,
            lambda: self.describe(namespace, name),
        )  # fmt: skip
        return found

    def describe(self, namespace: str, name: str) -> str:
        """The job's status and where its pods are: what a timeout reports."""
        lines = [json.dumps(self.status(namespace, name), indent=1)]
        for pod in self.pods(namespace, name):
            lines.append(f"{pod.metadata.name} on {pod.spec.node_name}: {pod.status.phase}")
        return "\n".join(lines)

    def node_of(self, pod: Any) -> str:
        return str(pod.spec.node_name)

    def victim(self, namespace: str, name: str, attempt: int) -> Any:
        """The pod of ``attempt`` whose node to stop: the highest node rank on a node that
        runs neither the operator, the S3 server nor Kubeflow's controller (losing those is
        another test)."""
        keep = {
            p.spec.node_name
            for ns in (OPERATOR_NAMESPACE, S3_NAMESPACE, KUBEFLOW_NAMESPACE)
            for p in self.core.list_namespaced_pod(ns).items
        }
        pods = sorted(self.attempt_pods(namespace, name, attempt), key=lambda p: p.metadata.name)
        candidates = [p for p in pods if p.spec.node_name not in keep]
        if not candidates:
            raise RuntimeError(
                f"every node of the job also runs the operator or the S3 server: {sorted(keep)}"
            )
        return candidates[-1]

    def control_plane_nodes(self) -> list[str]:
        nodes = self.core.list_node(label_selector=CONTROL_PLANE_LABEL).items
        return [n.metadata.name for n in nodes]

    def node_back(self, node: str, since: float) -> bool:
        """The node's kubelet renewed its Lease after ``since`` (a Ready condition can be
        the one from before the node stopped, until the node-monitor grace period ends)."""
        try:
            lease = client.CoordinationV1Api(self.api_client).read_namespaced_lease(
                node, "kube-node-lease"
            )
        except client.ApiException:
            return False
        renewed = lease.spec.renew_time
        return bool(renewed and renewed.timestamp() > since and self.node_ready(node))

    def node_ready(self, node: str) -> bool:
        try:
            conditions = self.core.read_node(node).status.conditions or []
        except client.ApiException:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    def wait(
        self,
        condition: Callable[[], Any],
        what: str,
        timeout: float,
        diagnostics: Callable[[], str] | None = None,
    ) -> Any:
        start = time.monotonic()
        result = wait_until(
            condition, timeout=timeout, what=what, interval=1.0, on_timeout=diagnostics
        )
        self.log(f"  {what}: {time.monotonic() - start:.0f}s")
        return result

    def delete_job(self, namespace: str, name: str) -> None:
        self.kubectl("delete", "ctj", name, "-n", namespace, "--wait=true", "--timeout=120s")

    def children(self, namespace: str, name: str) -> list[str]:
        """Every object in ``namespace`` the job owns or labels (pods, services, secrets,
        config maps, PyTorchJobs), as kind/name."""
        found = []
        if self.serves_pytorchjobs():
            listing = self.custom.list_namespaced_custom_object(
                "kubeflow.org", "v1", namespace, "pytorchjobs",
                label_selector=f"{LABEL_JOB}={name}",
            )  # fmt: skip
            found += [f"pytorchjob/{o['metadata']['name']}" for o in listing["items"]]
        listings: list[tuple[str, Callable[..., Any]]] = [
            ("pod", self.core.list_namespaced_pod),
            ("service", self.core.list_namespaced_service),
            ("secret", self.core.list_namespaced_secret),
            ("configmap", self.core.list_namespaced_config_map),
        ]
        for kind, list_fn in listings:
            for obj in list_fn(namespace).items:
                labels = obj.metadata.labels or {}
                owners = [
                    o.name
                    for o in obj.metadata.owner_references or []
                    if o.kind == "CheckpointedTrainingJob"
                ]
                if labels.get(LABEL_JOB) == name or name in owners:
                    found.append(f"{kind}/{obj.metadata.name}")
        return found
