"""ctj's stack on a real cluster: installing the chart, the S3 server and Kubeflow's
controller with our images (thin adapters over kubectl, helm and the Kubernetes API), and
the cluster harness over it (ctj_stack.harness: reading a job back, stopping a node)."""

from __future__ import annotations

import functools
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
from ctj_contract import NODE_CACHE_DRIVER
from ctj_devcluster.binaries import built_dirs
from ctj_devcluster.cluster import wait_crd_established
from kubernetes import client, config

from .harness import Harness

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ctj"
EXAMPLES = ROOT / "examples"
EXAMPLE_JOB = EXAMPLES / "job.yaml"
# The job namespace's Pod Security labels: enforce rejects, warn and audit say why
POD_SECURITY_RESTRICTED = {
    f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")
}
SEAWEEDFS_MANIFEST = ROOT / "deploy" / "seaweedfs" / "seaweedfs.yaml"
KUBEFLOW_MANIFEST = ROOT / "deploy" / "kubeflow" / "training-operator.yaml"
S3_NAMESPACE = "seaweedfs"
S3_SERVER = "seaweedfs"  # its StatefulSet; the pod is seaweedfs-0
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
KUBEFLOW_NAMESPACE = "kubeflow"
KUEUE_NAMESPACE = "kueue-system"  # where Kueue's manifests put it
JOBSET_NAMESPACE = "jobset-system"  # where JobSet's config/default puts it
TRAINER_NAMESPACE = "kubeflow-system"  # where Trainer's manifests/overlays/manager puts it
KUBEFLOW_WEBHOOK = "validator.training-operator.kubeflow.org"
OPERATOR_NAMESPACE = "ctj-system"
LEADER_LEASE = "ctj-operator"  # the operator's default --leader-election-name
S3_ENDPOINT = "http://seaweedfs.seaweedfs:8333"  # the example job's, in-cluster
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
    kueue: str = ""  # Kueue's manager (deploy/kueue); "": no Kueue is installed
    jobset: str = ""  # JobSet's manager (deploy/jobset); "": no Kubeflow Trainer is installed
    kubeflow_trainer: str = ""  # Kubeflow Trainer v2's manager (deploy/kubeflow-trainer)
    sidecar: str = ""  # the checkpoint sidecar (no torch); "": the trainer image serves

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Images:
        env = dict(os.environ if env is None else env)
        hint = "build them with hack/containers/images.sh (it prints CTJ_*_IMAGE=...)"
        return cls(
            operator=_required(env, "CTJ_OPERATOR_IMAGE", hint),
            trainer=_required(env, "CTJ_TRAINER_IMAGE", hint),
            seaweedfs=_required(env, "CTJ_SEAWEEDFS_IMAGE", hint),
            kubeflow=env.get("CTJ_KUBEFLOW_IMAGE", ""),
            kueue=env.get("CTJ_KUEUE_IMAGE", ""),
            jobset=env.get("CTJ_JOBSET_IMAGE", ""),
            kubeflow_trainer=env.get("CTJ_KUBEFLOW_TRAINER_IMAGE", ""),
            sidecar=env.get("CTJ_SIDECAR_IMAGE", ""),
        )


def _run_manager(objects: list[dict[str, Any]], image: str, control_plane: bool) -> None:
    """A controller's rendered install, its Deployment's one container run from ``image``
    (loaded on the nodes: never pulled) and, with ``control_plane``, on the control-plane
    node (its webhooks must answer while workers are lost)."""
    for obj in objects:
        if obj["kind"] == "Deployment":
            pod = obj["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            container["image"] = image
            container["imagePullPolicy"] = "IfNotPresent"
            if control_plane:
                pod["tolerations"] = [CONTROL_PLANE_TOLERATION]
                pod["nodeSelector"] = {CONTROL_PLANE_LABEL: ""}


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


def _main_pid(container_id: str) -> str:
    """Shell that prints, on the container's node, the pid of its main process (crictl)."""
    container = container_id.split("://", 1)[-1]
    return f"$(crictl inspect --output go-template --template '{{{{.info.pid}}}}' {container})"


@dataclass(frozen=True)
class NodeControl:
    """How to stop and start a node, as shell command templates with ``{node}``: on kind
    ``docker kill {node}`` and ``docker start {node}`` (CTJ_E2E_NODE_STOP/START); and how
    to run a command on it, ``docker exec {node}`` (CTJ_E2E_NODE_EXEC, optional)."""

    stop: str
    start: str
    exec: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> NodeControl | None:
        env = dict(os.environ if env is None else env)
        stop, start = env.get("CTJ_E2E_NODE_STOP", ""), env.get("CTJ_E2E_NODE_START", "")
        run = env.get("CTJ_E2E_NODE_EXEC", "")
        return cls(stop, start, run) if stop and start else None

    def _run(self, template: str, node: str, *args: str) -> None:
        command = template.format(node=shlex.quote(node))
        if args:
            command += " " + shlex.join(args)
        subprocess.run(command, shell=True, check=True, stdout=subprocess.DEVNULL)

    def run_on(self, node: str, *args: str) -> None:
        """Runs ``args`` on the node (CTJ_E2E_NODE_EXEC)."""
        if not self.exec:
            raise RuntimeError("no way to run a command on a node here: set CTJ_E2E_NODE_EXEC")
        self._run(self.exec, node, *args)

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


class Stack(Harness):
    """One real cluster: install, apply, read back. ``nodes``: how to stop and start its
    nodes (None: a scenario that loses a node cannot run here)."""

    def __init__(
        self,
        kubeconfig: Path,
        images: Images,
        tools: Tools | None = None,
        log: Callable[[str], None] = print,
        nodes: NodeControl | None = None,
    ) -> None:
        super().__init__(config.new_client_from_config(str(kubeconfig)), log)
        self.kubeconfig = kubeconfig
        self.images = images
        self.tools = tools or Tools.find()
        self.nodes = nodes
        self.apps = client.AppsV1Api(self.api_client)
        self.stopped: set[str] = set()  # nodes a scenario stopped and has not started again

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

    # --- installing -----------------------------------------------------------------

    def install_operator(
        self, namespace: str = OPERATOR_NAMESPACE, release: str = "ctj", control_plane: bool = False
    ) -> None:
        """The chart, with our images, as a user installs it; waits until it is Ready.
        ``control_plane``: run the operator on the control-plane node (a test cluster's
        way to lose a worker without losing the operator too)."""
        repo, tag = _repo_tag(self.images.operator)
        sidecar_repo, sidecar_tag = _repo_tag(self.images.sidecar or self.images.trainer)
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

    def uninstall_operator(
        self, namespace: str = OPERATOR_NAMESPACE, release: str = "ctj", timeout: float = 240
    ) -> None:
        """``helm uninstall``, as docs/deploy.md says to: first every pod that mounts a
        job's node cache (the agents' CSI volume) gone, since a pod's teardown needs its
        node's mounter to unmount it; the chart's agents would otherwise go first and leave
        such pods Terminating until a mounter is back."""

        def mounting() -> list[str]:
            return [
                f"{p.metadata.namespace}/{p.metadata.name}"
                for p in self.core.list_pod_for_all_namespaces().items
                if any(v.csi and v.csi.driver == NODE_CACHE_DRIVER for v in p.spec.volumes or [])
            ]

        self.wait(lambda: not mounting(), "every pod with a node cache volume gone", timeout,
                  lambda: ", ".join(mounting()))  # fmt: skip
        self.helm("uninstall", release, "-n", namespace, "--wait")

    def install_s3(self, credentials: S3Credentials) -> None:
        """deploy/seaweedfs with our image and a Secret of the given keys; waits until the
        gateway can be reached. Its data is a PersistentVolumeClaim of the cluster's default
        StorageClass, kept when the pod goes."""
        self.log(f"S3 server: deploy/seaweedfs/seaweedfs.yaml ({self.images.seaweedfs})")
        self._check_default_storage_class()
        objects = [o for o in yaml.safe_load_all(SEAWEEDFS_MANIFEST.read_text()) if o]
        identities = credentials.identities_json()
        for obj in objects:
            if obj["kind"] == "StatefulSet":
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
        # the Deployment of earlier versions (an emptyDir) would share the Service's pods
        self.kubectl("-n", S3_NAMESPACE, "delete", "deployment", S3_SERVER, "--ignore-not-found",
                     "--wait=true")  # fmt: skip
        self.apply([o for o in objects if o["kind"] != "Namespace"])
        self.kubectl("-n", S3_NAMESPACE, "rollout", "status", f"statefulset/{S3_SERVER}",
                     "--timeout=180s")  # fmt: skip

    def _check_default_storage_class(self) -> None:
        """The S3 server's volume must come back with its pod: a kind cluster made before
        hack/kind/storage.yaml's local-path provisioner has the controller-manager's
        host-path one (no node affinity, not writable by a non-root server)."""
        classes = client.StorageV1Api(self.api_client).list_storage_class().items
        default = [
            c for c in classes
            if (c.metadata.annotations or {}).get(DEFAULT_CLASS_ANNOTATION) == "true"
        ]  # fmt: skip
        if not default:
            raise RuntimeError(
                "the cluster has no default StorageClass: deploy/seaweedfs's volume claim "
                "would never bind (mark one with storageclass.kubernetes.io/is-default-class)"
            )
        if any(c.provisioner == "kubernetes.io/host-path" for c in default):
            raise RuntimeError(
                "the default StorageClass is the host-path provisioner's (a kind cluster made "
                "before hack/kind/storage.yaml): recreate it with "
                "'hack/kind/cluster.sh down && hack/kind/cluster.sh up'"
            )

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

    def install_kueue(self, control_plane: bool = False) -> Path:
        """Kueue as its own release manifests install it (config/default of the module it is
        built from: CRDs, webhooks, its certificate rotation, the pod integration on), with
        our image of its manager; waits until it serves. Returns the manifests, for
        ``uninstall_kueue``."""
        from ctj_devcluster.kueue import KueueBuild

        manifests = KueueBuild.find().manifests
        self.log(f"Kueue: {manifests} ({self.images.kueue})")
        # one change: its on-demand visibility API off. On this cluster (Kubernetes 1.34)
        # the aggregated API it registers answers its discovery with 404, and an APIService
        # that fails discovery slows or breaks every client that reads all of discovery
        objects = [o for o in yaml.safe_load_all(manifests.read_text())
                   if o and o["kind"] != "APIService"]  # fmt: skip
        for obj in objects:
            if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "kueue-manager-config":
                key = "controller_manager_config.yaml"
                config = yaml.safe_load(obj["data"][key])
                config["featureGates"] = {**(config.get("featureGates") or {}),
                                          "VisibilityOnDemand": False}  # fmt: skip
                obj["data"][key] = yaml.safe_dump(config)
        _run_manager(objects, self.images.kueue, control_plane)
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     stdin=yaml.safe_dump_all(objects))  # fmt: skip
        for crd in ("workloads", "clusterqueues", "localqueues", "resourceflavors"):
            wait_crd_established(self.kubectl, f"{crd}.kueue.x-k8s.io")
        self.kubectl("-n", KUEUE_NAMESPACE, "rollout", "status",
                     "deployment/kueue-controller-manager", "--timeout=300s")  # fmt: skip
        jsonpath = "{.webhooks[0].clientConfig.caBundle}"

        def ca_injected() -> bool:
            got = self.kubectl("get", "mutatingwebhookconfiguration",
                               "kueue-mutating-webhook-configuration",
                               f"-o=jsonpath={jsonpath}")  # fmt: skip
            return bool(got.strip())

        self.wait(ca_injected, "Kueue's webhooks' CA in place", 120)
        # its webhooks (failurePolicy Fail) stand between every client and a Deployment,
        # a Job or a pod in most namespaces: wait until one answers a dry run
        labels = {"app": "kueue-probe"}
        template = {"metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "x"}]}}  # fmt: skip
        probe = {"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": {"name": "kueue-probe", "namespace": "default"},
                 "spec": {"selector": {"matchLabels": labels}, "template": template}}  # fmt: skip
        self._wait_dry_run(probe, "Kueue's webhooks answering")
        return manifests

    def _wait_dry_run(self, obj: dict[str, Any], what: str, timeout: float = 120) -> None:
        """Until the API server accepts a server-side dry-run create of ``obj`` (its
        admission webhooks, failurePolicy Fail, answer: their CA is in place and their
        server up); the last refusal is in the timeout's message."""
        last = [""]

        def accepted() -> bool:
            try:
                self.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(obj))
            except RuntimeError as exc:
                last[0] = str(exc)
                return False
            return True

        self.wait(accepted, what, timeout, diagnostics=lambda: last[0])

    def install_trainer(self, control_plane: bool = False) -> None:
        """Kubeflow Trainer v2 (TrainJob, TrainingRuntime, ClusterTrainingRuntime) and the
        JobSet it makes of each TrainJob, as their own manifests install them (rendered
        from the modules they are built from: JobSet's config/default, the trainer's
        manifests/overlays/manager; each with its internal certificate rotation for its
        webhooks), with our images of their managers. Waits until each one's CRDs are
        established, its Deployment is rolled out and its webhooks answer a dry run.
        ``control_plane``: both managers on the control-plane node (JobSet's pod webhooks,
        failurePolicy Fail, stand between a JobSet's pods and the API server). Again on a
        cluster that has them: a no-op apply and the same waits."""
        from ctj_devcluster.trainer import jobset_build, trainer_build

        wanted = {"CTJ_JOBSET_IMAGE": self.images.jobset,
                  "CTJ_KUBEFLOW_TRAINER_IMAGE": self.images.kubeflow_trainer}  # fmt: skip
        for env, image in wanted.items():
            if not image:
                raise ValueError(f"{env} is not set: build it with hack/containers/images.sh")
        jobset, trainer = jobset_build(), trainer_build()
        self.log(f"JobSet: {jobset.manifests} ({self.images.jobset})")
        # nothing of config/default to drop (its CRD's cert-manager annotation is inert
        # without cert-manager; no ServiceMonitor, no APIService, no other image). One
        # change: its manager's CPU request, 500m, made 100m. A kind node has 2 CPUs and
        # the control plane's own pods ask 920m of them: with Kueue's 500m beside it (both
        # pinned there) neither the operator nor Kubeflow's controller would fit.
        self._apply_manager(jobset.manifests, self.images.jobset, control_plane, cpu="100m")
        wait_crd_established(self.kubectl, "jobsets.jobset.x-k8s.io")
        self.kubectl("-n", JOBSET_NAMESPACE, "rollout", "status",
                     "deployment/jobset-controller-manager", "--timeout=300s")  # fmt: skip
        container = {"name": "c", "image": "x"}
        probe_job = {"template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}
        self._wait_dry_run({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "ctj-probe", "namespace": "default"},
            "spec": {"replicatedJobs": [{"name": "r", "template": {"spec": probe_job}}]},
        }, "JobSet's webhooks answering")  # fmt: skip

        self.log(f"Kubeflow Trainer: {trainer.manifests} ({self.images.kubeflow_trainer})")
        # as rendered (overlays/manager less its JobSet, which the build leaves out: it
        # would be fetched from GitHub): no runtimes, so no image but the manager's
        self._apply_manager(trainer.manifests, self.images.kubeflow_trainer, control_plane)
        for crd in ("trainjobs", "trainingruntimes", "clustertrainingruntimes"):
            wait_crd_established(self.kubectl, f"{crd}.trainer.kubeflow.org")
        self.kubectl("-n", TRAINER_NAMESPACE, "rollout", "status",
                     "deployment/kubeflow-trainer-controller-manager",
                     "--timeout=300s")  # fmt: skip
        node = {"name": "node", "image": "x"}
        self._wait_dry_run({
            "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
            "metadata": {"name": "ctj-probe", "namespace": "default"},
            "spec": {"mlPolicy": {"numNodes": 1}, "template": {"spec": {"replicatedJobs": [{
                "name": "node",
                "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step":
                                            "trainer"}},
                    "spec": {"template": {"spec": {"containers": [node]}}},
                },
            }]}}},
        }, "Kubeflow Trainer's webhooks answering")  # fmt: skip

    def _apply_manager(
        self, manifests: Path, image: str, control_plane: bool, cpu: str = ""
    ) -> None:
        """``manifests`` (a controller's own install), its manager run from ``image``
        (``cpu``: its CPU request instead of the manifests')."""
        objects = [o for o in yaml.safe_load_all(manifests.read_text()) if o]
        _run_manager(objects, image, control_plane)
        for obj in objects:
            if cpu and obj["kind"] == "Deployment":
                (container,) = obj["spec"]["template"]["spec"]["containers"]
                container.setdefault("resources", {}).setdefault("requests", {})["cpu"] = cpu
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     stdin=yaml.safe_dump_all(objects))  # fmt: skip

    def uninstall_kueue(self, manifests: Path) -> None:
        """Kueue's objects while its manager still runs (it removes their finalizers: a
        ClusterQueue outliving it would hold its CRD's deletion for ever), then its webhooks
        (no pod creation may wait on a manager being removed), then the rest."""
        for kinds in ("workloads,localqueues", "clusterqueues,resourceflavors,"
                      "workloadpriorityclasses"):  # fmt: skip
            self.kubectl("delete", kinds, "--all", "-A", "--wait=true", "--timeout=120s")
        for kind in ("mutating", "validating"):
            self.kubectl("delete", f"{kind}webhookconfiguration",
                         f"kueue-{kind}-webhook-configuration", "--ignore-not-found")  # fmt: skip
        self.kubectl("delete", "-f", str(manifests), "--ignore-not-found", "--wait=true",
                     "--timeout=180s")  # fmt: skip

    def restart_operator(self, namespace: str = OPERATOR_NAMESPACE) -> None:
        """A rollout of the operator (it looks for the APIs it drives, Kueue's, at start)."""
        self.kubectl("-n", namespace, "rollout", "restart", "deployment/ctj")
        self.kubectl("-n", namespace, "rollout", "status", "deployment/ctj", "--timeout=180s")

    @staticmethod
    def _secret(namespace: str, name: str, data: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "stringData": data,
        }

    def job_namespace(self, namespace: str, credentials: S3Credentials) -> None:
        """A namespace for jobs, with the example's ``s3-credentials`` Secret, that enforces
        the `restricted` Pod Security Standard as a platform team's would: the API server
        rejects any pod of ours (sidecar, init steps) or of the example that breaks it."""
        self.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": namespace, "labels": POD_SECURITY_RESTRICTED,
        }}])  # fmt: skip
        self.apply([self._secret(namespace, "s3-credentials", {
            "AWS_ACCESS_KEY_ID": credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": credentials.secret_key,
        })])  # fmt: skip

    def example_job(
        self, name: str = "demo", backend: str = "pods", example: str = "job.yaml", **env: str
    ) -> dict[str, Any]:
        """examples/``example`` with our trainer image (and ``env`` set in the trainer),
        named ``name``, run by ``backend``."""
        job: dict[str, Any] = yaml.safe_load((EXAMPLES / example).read_text())
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

    # --- the harness: what is this cluster's own ------------------------------------

    def container_log(self, namespace: str, pod: str, container: str) -> str | None:
        try:
            text: str = self.core.read_namespaced_pod_log(pod, namespace, container=container)
        except client.ApiException:
            return None
        return text

    def _node_control(self) -> NodeControl:
        if self.nodes is None:
            raise RuntimeError("no way to stop a node here: set CTJ_E2E_NODE_STOP/START")
        return self.nodes

    def stop_node(self, node: str) -> None:
        self._node_control().stop_node(node)
        self.stopped.add(node)

    def start_node(self, node: str) -> None:
        self._node_control().start_node(node)
        self.stopped.discard(node)

    def start_stopped_nodes(self) -> None:
        """Starts every node a scenario stopped and left down (its step failed before the
        node's return) and waits for their kubelets: the next scenario gets the whole
        cluster, not one node short."""
        for node in sorted(self.stopped):
            started = time.time()
            self.log(f"starting node {node}, left stopped by a failed step")
            self.start_node(node)
            self.wait(functools.partial(self.node_back, node, started),
                      f"node {node}'s kubelet back", 300)  # fmt: skip

    def signal_trainer(self, namespace: str, pod: str, signal: str) -> None:
        """On the pod's node: the trainer container's main process, by its container ID
        (crictl), and the process group of each of its children (under the ctj launcher,
        the worker's) get ``signal`` (a SIGSTOP from the node's PID namespace reaches them;
        from inside the container it would not reach its PID 1)."""
        node, container = self.trainer_container(namespace, pod)
        pid = _main_pid(container)
        sig = shlex.quote(signal)
        script = (
            f'p="{pid}"; for c in $(cat /proc/$p/task/*/children); do kill -s {sig} -- "-$c"; '
            f'done; kill -s {sig} "$p"'
        )
        self._node_control().run_on(node, "sh", "-c", script)

    def crash_operator(self) -> str:
        """The pod that holds the chart's leader Lease gets its operator killed on its node
        (SIGKILL to the container's main process, as an OOM kill would): the kubelet
        restarts the container, and whichever replica takes the Lease first leads."""
        coordination = client.CoordinationV1Api(self.api_client)
        lease = coordination.read_namespaced_lease(LEADER_LEASE, OPERATOR_NAMESPACE)
        holder = str(lease.spec.holder_identity or "")
        # the identity is "<hostname>-<8 hex>", and a pod's hostname is its name
        leader = next((p for p in self.core.list_namespaced_pod(OPERATOR_NAMESPACE).items
                       if holder.rsplit("-", 1)[0] == p.metadata.name), None)  # fmt: skip
        if leader is None:
            raise RuntimeError(f"no operator pod holds the Lease (holder {holder!r})")
        (container,) = [c.container_id for c in leader.status.container_statuses or []]
        node = str(leader.spec.node_name)
        self._node_control().run_on(node, "sh", "-c", f"kill -9 {_main_pid(str(container))}")
        return holder

    def reserved_nodes(self) -> set[str]:
        """Nodes that run the operator, the S3 server or Kubeflow's controller (not the
        node agents: a DaemonSet's pods are on every node, and one lost with its node is
        what the node-loss test is about)."""
        return {
            p.spec.node_name
            for ns in (OPERATOR_NAMESPACE, S3_NAMESPACE, KUBEFLOW_NAMESPACE)
            for p in self.core.list_namespaced_pod(ns).items
            if not any(o.kind == "DaemonSet" for o in p.metadata.owner_references or [])
        }

    def control_plane_nodes(self) -> list[str]:
        nodes = self.core.list_node(label_selector=CONTROL_PLANE_LABEL).items
        return [n.metadata.name for n in nodes]
