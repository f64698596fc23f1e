"""Pure builders of the objects the operator creates: Service, pods, PyTorchJob, TrainJob.

Each returns a plain dict ready for the Kubernetes API. The pods get the
environment a Kubeflow PyTorchJob gives (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, PET_*), so training scripts run unchanged, plus the checkpoint sidecar
(a native sidecar: an init container that keeps running) and the memory-backed
staging volume they share. Credentials only ever travel as secretKeyRefs.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ctj_contract import (
    ANNOTATION_AVOID,
    CACHE_TOKEN_KEY,
    GROUP,
    KIND,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_LAUNCHER,
    LABEL_RANK,
    LABEL_SPARE,
    LABEL_WORLD,
    NODE_CACHE_MOUNT_PATH,
    VERSION,
    Assignment,
    Env,
    NodeCacheVolume,
)
from ctj_contract.launch import LAUNCHER_MODULE

from .spec import Backend, JobSpec, resume_source

MASTER_PORT = 29500
METRICS_PORT = 9400
SIDECAR_STARTUP_WAIT_S = 25  # one startup probe's wait for /readyz (it exits when ready)
STAGING_PATH = "/ctj/staging"
CACHE_PORT = 9402  # each sidecar tells the job's peers where its node's agent is, here
# The Dockerfile's `sidecar` target (no torch), as the chart names it; the chart and
# --sidecar-image / CTJ_SIDECAR_IMAGE set the operator's, a job's sidecarImage its own.
DEFAULT_SIDECAR_IMAGE = "ghcr.io/ctj/sidecar:0.1.0"
SIDECAR_NAME = "ctj-sidecar"
# Requests equal to limits, cpu and memory both: a pod whose own containers are Guaranteed
# stays Guaranteed with ours added (the kubelet computes QoS over every container, init
# containers included), so it keeps its exclusive CPUs and topology alignment. One core: a
# sidecar's start (imports, ~1 s of CPU) delays the trainer's. A job's
# spec.checkpoint.sidecarResources replaces the sidecar's as a whole.
DEFAULT_SIDECAR_RESOURCES = {
    "requests": {"cpu": "1", "memory": "1Gi"},
    "limits": {"cpu": "1", "memory": "1Gi"},
}
# The restricted Pod Security Standard, and a read-only root: the sidecar writes only to
# its volumes (staging, its own /tmp). No runAsUser: the image's numeric USER (65532 in
# the Dockerfile) stays the one that reads the trainer's staged files, as before;
# runAsNonRoot makes the kubelet refuse an image that would run as root.
SIDECAR_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
SIDECAR_TMP_VOLUME = "ctj-sidecar-tmp"
NODE_CACHE_VOLUME = "ctj-node-cache"
SIDECAR_TMP_SIZE = "64Mi"  # for libraries that want a temp dir; staging has its own volume
# what the Kubeflow controller labels its pods with (rank = 0 for the master, index + 1 else)
KF_REPLICA_TYPE = "training.kubeflow.org/replica-type"
KF_REPLICA_INDEX = "training.kubeflow.org/replica-index"
KF_PORT_NAME = "pytorchjob-port"  # the container port it reads MASTER_PORT from
# Kubeflow Trainer v2 (backend trainjob): its API, the replicated job and container it
# requires of a runtime (the "trainer" ancestor, a container named "node"), and what the
# Job controller puts on each pod of an Indexed Job: its index, which is the node rank
TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOB_ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINJOB_REPLICATED_JOB = "node"
TRAINJOB_CONTAINER = "node"
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


@dataclasses.dataclass(frozen=True, slots=True)
class ControllerApi:
    """Where a backend's attempt object is served: the controller that runs it is not ours."""

    group: str
    version: str
    plural: str


CONTROLLED = {
    Backend.PYTORCHJOB: ControllerApi("kubeflow.org", "v1", "pytorchjobs"),
    Backend.TRAINJOB: ControllerApi(TRAINER_GROUP, TRAINER_VERSION, "trainjobs"),
}
"""The backends whose attempt is one object another controller runs (``attempt_name``)."""
TRAINING_RUNTIMES = ControllerApi(TRAINER_GROUP, TRAINER_VERSION, "trainingruntimes")


def master_port(attempt: int) -> int:
    """A fresh rendezvous port per attempt: a straggler of an old attempt can never join."""
    return MASTER_PORT + attempt % 1000


def pod_name(job: str, attempt: int, node_rank: int) -> str:
    return f"{job}-a{attempt}-{node_rank}"


def attempt_name(job: str, attempt: int) -> str:
    """The PyTorchJob or the TrainJob (and its TrainingRuntime) that runs ``attempt``."""
    return f"{job}-a{attempt}"


def trainjob_hostname(job: str, attempt: int, node_rank: int) -> str:
    """The hostname JobSet gives node rank ``node_rank`` of the attempt's TrainJob (its
    replicated job ``node``, one Job, pod index = rank), under the subdomain (and headless
    Service) ``attempt_name``. The pod's own name ends in a random suffix."""
    return f"{attempt_name(job, attempt)}-{TRAINJOB_REPLICATED_JOB}-0-{node_rank}"


def rank_pod_name(spec: JobSpec, job: str, attempt: int, node_rank: int) -> str:
    """The pod holding ``node_rank``, named by us (backend pods) or, as the Kubeflow
    controller names them, ``<pytorchjob>-master-0`` and ``<pytorchjob>-worker-<i>``
    (backend trainjob: the rank's hostname; the Job controller names the pod after it)."""
    if spec.backend == Backend.TRAINJOB:
        return trainjob_hostname(job, attempt, node_rank)
    if spec.backend != Backend.PYTORCHJOB:
        return pod_name(job, attempt, node_rank)
    base = attempt_name(job, attempt)
    return f"{base}-master-0" if node_rank == 0 else f"{base}-worker-{node_rank - 1}"


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def build_service(body: dict[str, Any]) -> dict[str, Any]:
    """Headless, so every pod of the gang gets <pod>.<job>.<ns>.svc DNS names."""
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "labels": {LABEL_JOB: name},
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: name},
            "ports": [{"name": "c10d", "port": MASTER_PORT}],
        },
    }


def _storage_env(spec: JobSpec, uri: str) -> list[dict[str, Any]]:
    ck = spec.checkpoint
    env: list[dict[str, Any]] = [
        {"name": Env.CHECKPOINT_URI, "value": uri},
        {"name": Env.CHECKPOINT_MODE, "value": ck.mode},
        {"name": Env.CHECKPOINT_FULL_EVERY, "value": str(ck.full_every)},
        {"name": Env.CHECKPOINT_KEEP_LAST, "value": str(ck.keep_last)},
        {"name": Env.STAGING_DIR, "value": STAGING_PATH},
        {"name": Env.SIDECAR, "value": "1"},
    ]
    if ck.endpoint:
        env.append({"name": Env.S3_ENDPOINT, "value": ck.endpoint})
    if ck.credentials_secret:
        for key in (Env.S3_ACCESS_KEY, Env.S3_SECRET_KEY):
            env.append(
                {
                    "name": key,
                    "valueFrom": {"secretKeyRef": {"name": ck.credentials_secret, "key": key}},
                }
            )
    return env


def _resume_env(spec: JobSpec, uri: str) -> list[dict[str, Any]]:
    """spec.checkpoint.resumeFrom for the trainer (only it loads): read when the job's own
    location ``uri`` holds no committed checkpoint yet."""
    source = resume_source(spec, uri)
    if source is None:
        return []
    env = [{"name": Env.RESUME_FROM, "value": source.uri}]
    if source.job is not None:
        env.append({"name": Env.RESUME_FROM_JOB, "value": source.job})
    return env


def cache_secret_name(job: str) -> str:
    return f"{job}-ctj-cache"


def build_cache_secret(body: dict[str, Any], token: str) -> dict[str, Any]:
    """The job's secret for its peer caches: only the job's pods read it (secretKeyRef)."""
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": cache_secret_name(name),
            "labels": {LABEL_JOB: name},
            "ownerReferences": [owner_reference(body)],
        },
        "type": "Opaque",
        "stringData": {CACHE_TOKEN_KEY: token},
    }


def _node_cache(
    pod_spec: dict[str, Any], spec: JobSpec, body: dict[str, Any], peers: list[str]
) -> None:
    """The node tier in the trainer and the sidecar: the node agent's address (the node's
    own, from the downward API: the agent's hostPort is there), the job's identity (its
    path on the agents) and token, and ``peers`` (host:port of every rank's sidecar, this
    one's included: a process leaves out its own hostname), which tell a restoring rank
    where their nodes' agents are. No hostPath, no root step: the agent owns the disk.
    Where the agents serve their CSI driver, the trainer also mounts the job's directory
    of the node's cache read-only (an inline ``csi`` volume, which ``restricted`` allows)
    and reads its node's chunks there, not over a socket."""
    cache = spec.checkpoint.node_cache
    if cache is None:
        return
    meta = body["metadata"]
    env: list[dict[str, Any]] = [
        {"name": Env.NODE_AGENT_HOST, "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": Env.NODE_AGENT_PORT, "value": str(cache.port)},
        {"name": Env.JOB_NAMESPACE, "value": meta["namespace"]},
        {"name": Env.JOB_NAME, "value": meta["name"]},
        {"name": Env.JOB_UID, "value": meta["uid"]},
        {"name": Env.CACHE_PEERS, "value": ",".join(peers)},
        {
            "name": Env.CACHE_TOKEN,
            "valueFrom": {
                "secretKeyRef": {"name": cache_secret_name(meta["name"]), "key": CACHE_TOKEN_KEY}
            },
        },
    ]
    sidecar = pod_spec["initContainers"][-1]
    for container in (pod_spec["containers"][0], sidecar):
        _merge_env(container, env)
    if cache.driver is not None:
        trainer = pod_spec["containers"][0]
        _merge_env(trainer, [{"name": Env.NODE_CACHE_MOUNT, "value": NODE_CACHE_MOUNT_PATH}])
        trainer.setdefault("volumeMounts", []).append(
            {"name": NODE_CACHE_VOLUME, "mountPath": NODE_CACHE_MOUNT_PATH, "readOnly": True}
        )
        pod_spec.setdefault("volumes", []).append({
            "name": NODE_CACHE_VOLUME,
            "csi": {
                "driver": cache.driver,
                "readOnly": True,
                "volumeAttributes": {
                    NodeCacheVolume.JOB.value: meta["name"],
                    NodeCacheVolume.UID.value: meta["uid"],
                },
            },
        })  # fmt: skip
    sidecar["env"].append({"name": Env.CACHE_PORT, "value": str(CACHE_PORT)})
    sidecar["ports"].append({"name": "peer-cache", "containerPort": CACHE_PORT})


def _merge_env(container: dict[str, Any], env: list[dict[str, Any]]) -> None:
    """Ours win over the template's for the same name; the template's others stay."""
    ours = {e["name"] for e in env}
    container["env"] = [e for e in container.get("env") or [] if e["name"] not in ours] + env


def _heartbeat_env(
    body: dict[str, Any], attempt: int, node_rank: int | None
) -> list[dict[str, Any]]:
    """What the sidecar answers the operator's heartbeat with (trainer_sidecar/heartbeat.py):
    the job's token, from its Secret (an ask without it is refused), its attempt and its
    node rank. ``node_rank`` None: a Worker template the Kubeflow controller stamps out,
    whose sidecar only needs to know it is not rank 0."""
    job = body["metadata"]["name"]
    env: list[dict[str, Any]] = [
        {
            "name": Env.CACHE_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": cache_secret_name(job), "key": CACHE_TOKEN_KEY}},
        },
        {"name": Env.ATTEMPT, "value": str(attempt)},
    ]
    if node_rank is not None:
        env.append({"name": Env.NODE_RANK, "value": str(node_rank)})
    return env


def _sidecar(spec: JobSpec, uri: str) -> dict[str, Any]:
    sidecar: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": spec.checkpoint.sidecar_image or DEFAULT_SIDECAR_IMAGE,
        "command": [
            "python",
            "-m",
            "trainer_sidecar",
            "sidecar",
            "--metrics-port",
            str(METRICS_PORT),
        ],
        "restartPolicy": "Always",  # a native sidecar: outlives nothing, stops after the trainer
        "env": _storage_env(spec, uri)
        + [{"name": Env.METRICS_HOST, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
        "volumeMounts": [
            {"name": "ctj-staging", "mountPath": STAGING_PATH},
            {"name": SIDECAR_TMP_VOLUME, "mountPath": "/tmp"},
        ],
        # Without a startup probe the first readiness probes hit a sidecar still importing
        # (refused) or not yet through to the store (503): an Unhealthy Warning on every
        # healthy start. The startup probe waits inside the container, in one exec, for
        # /readyz (readiness probes wait for it), so a healthy start fails no probe. As a
        # native sidecar's, it also holds the trainer until the sidecar has told it the
        # store's latest commit; a store still unreachable after ~10 minutes restarts it.
        "startupProbe": {
            "exec": {
                "command": [
                    "python",
                    "-m",
                    "trainer_sidecar.metrics",
                    "wait-ready",
                    "--port",
                    str(METRICS_PORT),
                    "--timeout",
                    str(SIDECAR_STARTUP_WAIT_S),
                ]
            },
            "timeoutSeconds": SIDECAR_STARTUP_WAIT_S + 5,
            "periodSeconds": 1,
            "failureThreshold": 20,
        },
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": METRICS_PORT}},
        "securityContext": copy.deepcopy(SIDECAR_SECURITY_CONTEXT),
    }
    sidecar["resources"] = copy.deepcopy(
        spec.checkpoint.sidecar_resources or DEFAULT_SIDECAR_RESOURCES
    )
    return sidecar


def _trainer_pod_spec(spec: JobSpec, uri: str, extra_env: list[dict[str, Any]]) -> dict[str, Any]:
    pod_spec = copy.deepcopy(spec.template.get("spec") or {})
    trainer = pod_spec["containers"][0]
    _merge_env(
        trainer,
        _storage_env(spec, uri)
        + [{"name": Env.SAVE_EVERY, "value": str(spec.checkpoint.interval_steps)}]
        + _resume_env(spec, uri)
        + extra_env,
    )
    trainer.setdefault("volumeMounts", []).append(
        {"name": "ctj-staging", "mountPath": STAGING_PATH}
    )
    # a trainer that dies says why in its pod's status (its last log lines, where it wrote
    # no termination message), and the operator quotes that in the job's conditions
    trainer.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    pod_spec["initContainers"] = list(pod_spec.get("initContainers") or []) + [_sidecar(spec, uri)]
    pod_spec.setdefault("volumes", []).extend(
        [
            {
                "name": "ctj-staging",
                "emptyDir": {"medium": "Memory", "sizeLimit": spec.checkpoint.staging_size_limit},
            },
            {"name": SIDECAR_TMP_VOLUME, "emptyDir": {"sizeLimit": SIDECAR_TMP_SIZE}},
        ]
    )
    pod_spec["restartPolicy"] = "Never"  # the gang restarts as a whole, at a new world size
    return pod_spec


SCHEDULING_FIELDS = ("nodeName", "nodeSelector", "affinity", "tolerations", "resources", "overhead")


def rank_footprint(spec: JobSpec) -> dict[str, Any]:
    """What the scheduler weighs of one rank's pod, from the spec alone: the template's
    placement fields and the requests of every container the pod will run, ours included
    (the sidecar), in the pod's order.
    capacity.py fits it to nodes; test_operator_builders ties it to ``build_pod``."""
    template = spec.template.get("spec") or {}
    footprint = {k: copy.deepcopy(template[k]) for k in SCHEDULING_FIELDS if k in template}

    def requests(container: dict[str, Any]) -> dict[str, Any]:
        kept = ("resources", "restartPolicy")
        return {k: copy.deepcopy(container[k]) for k in kept if k in container}

    init = [requests(c) for c in template.get("initContainers") or []]
    init.append(requests(_sidecar(spec, uri="")))
    footprint["containers"] = [requests(c) for c in template.get("containers") or []]
    footprint["initContainers"] = init
    return footprint


def placed(
    template: Mapping[str, Any],
    node_labels: Mapping[str, str],
    tolerations: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The pod template with what Kueue's admitted ResourceFlavors add (their node labels
    into nodeSelector, their tolerations), as Kueue's own job integrations add them."""
    out = copy.deepcopy(dict(template))
    pod_spec = out.setdefault("spec", {})
    pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), **node_labels}
    have = list(pod_spec.get("tolerations") or [])
    pod_spec["tolerations"] = have + [dict(t) for t in tolerations if dict(t) not in have]
    if not pod_spec["tolerations"]:
        del pod_spec["tolerations"]
    if not pod_spec["nodeSelector"]:
        del pod_spec["nodeSelector"]
    return out


def _place(pod_spec: dict[str, Any], job: str, avoid: tuple[str, ...]) -> None:
    """One pod of the job per node (losing a node loses one rank, not several; a spare is
    never beside a rank), off ``avoid``. Pods of an ended attempt are gone before the next
    one's are made, but for those it keeps (in-place restart), which hold their nodes."""
    pod_spec.setdefault("affinity", {})["podAntiAffinity"] = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "labelSelector": {"matchLabels": {LABEL_JOB: job}},
                "topologyKey": "kubernetes.io/hostname",
            }
        ]
    }
    if avoid:
        _avoid_nodes(pod_spec, avoid)


def _avoid_nodes(pod_spec: dict[str, Any], nodes: tuple[str, ...]) -> None:
    """Keep the scheduler off ``nodes`` (suspect: a rank there went silent, but the node
    reads Ready until its grace period ends): ``metadata.name NotIn`` added to every
    required nodeSelectorTerm (terms are ORed), or one term of its own."""
    avoid = {"key": "metadata.name", "operator": "NotIn", "values": list(nodes)}
    affinity = pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []}
    )
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchFields", []).append(dict(avoid))


def master_addr(job: str, rank0_pod: str) -> str:
    """The rendezvous host: node rank 0's pod, by its DNS name under the job's Service."""
    return f"{rank0_pod}.{job}"


def _launched(trainer: dict[str, Any]) -> None:
    """The trainer's command run under the ctj launcher (``ctj_contract.launch``), which
    keeps the pod up between attempts and restarts the command in place."""
    command = list(trainer["command"]) + list(trainer.pop("args", None) or [])
    trainer["command"] = ["python", "-m", LAUNCHER_MODULE, "--", *command]


def build_pod(
    body: dict[str, Any],
    spec: JobSpec,
    *,
    uri: str,
    attempt: int,
    world_size: int,
    node_rank: int,
    avoid: tuple[str, ...] = (),
    names: Sequence[str] = (),
) -> dict[str, Any]:
    """Node rank ``node_rank``'s pod. ``names``: every rank's pod by node rank, where some
    were kept from the attempt before (their names say that attempt); the rest, and all
    where empty, are ``pod_name(job, attempt, rank)``."""
    job = body["metadata"]["name"]
    by_rank = [names[r] if r < len(names) else pod_name(job, attempt, r) for r in range(world_size)]
    place = Assignment(
        attempt=attempt,
        node_rank=node_rank,
        world_size=world_size,
        nproc_per_node=spec.nproc_per_node,
        master_addr=master_addr(job, by_rank[0]),
        master_port=master_port(attempt),
    )
    labels = rank_labels(job, attempt, node_rank, world_size)
    return _pod(body, spec, uri, by_rank[node_rank], labels, place.environment(), by_rank,
                (attempt, node_rank), avoid)  # fmt: skip


def spare_name(job: str, attempt: int, index: int) -> str:
    """A warm spare made during ``attempt`` (index < 10000: no longer than a rank's name)."""
    return f"{job}-a{attempt}-s{index}"


def build_spare(
    body: dict[str, Any],
    spec: JobSpec,
    *,
    uri: str,
    name: str,
    peers: Sequence[str],
    avoid: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A warm spare: the pod a rank's would be, its launcher idle (``Env.STANDBY``) and its
    sidecar of attempt 0 with no rank, until an assignment makes it a rank (the operator
    relabels it, ``rank_labels``). ``peers``: the current attempt's pods, by node rank."""
    job = body["metadata"]["name"]
    labels = {LABEL_JOB: job, LABEL_SPARE: "true"}
    env = {Env.STANDBY: "1", Env.ATTEMPT: "0"}
    pod = _pod(body, spec, uri, name, labels, env, peers, (0, None), avoid)
    if avoid:
        pod["metadata"]["annotations"][ANNOTATION_AVOID] = ",".join(avoid)
    return pod


def _pod(
    body: dict[str, Any],
    spec: JobSpec,
    uri: str,
    name: str,
    labels: Mapping[str, str],
    trainer_env: Mapping[str, str],
    peer_pods: Sequence[str],
    heartbeat: tuple[int, int | None],
    avoid: tuple[str, ...],
) -> dict[str, Any]:
    job = body["metadata"]["name"]
    env = [{"name": k, "value": v} for k, v in trainer_env.items()]
    pod_spec = _trainer_pod_spec(spec, uri, env)
    if spec.relaunches:
        _launched(pod_spec["containers"][0])
    _node_cache(pod_spec, spec, body, [f"{pod}.{job}:{CACHE_PORT}" for pod in peer_pods])
    sidecar = pod_spec["initContainers"][-1]
    _merge_env(sidecar, _heartbeat_env(body, *heartbeat))
    pod_spec["hostname"] = name
    pod_spec["subdomain"] = job
    _place(pod_spec, job, avoid)
    launcher = {LABEL_LAUNCHER: "true"} if spec.relaunches else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            **_pod_metadata(spec, {**labels, **launcher}),
            "ownerReferences": [owner_reference(body)],
        },
        "spec": pod_spec,
    }


def rank_labels(job: str, attempt: int, node_rank: int, world_size: int) -> dict[str, str]:
    """What says which attempt and rank a pod holds: set at creation, and patched onto a
    pod kept for the next attempt (its launcher restarts the worker in place)."""
    return {
        LABEL_JOB: job,
        LABEL_ATTEMPT: str(attempt),
        LABEL_RANK: str(node_rank),
        LABEL_WORLD: str(world_size),
    }


def _pod_metadata(spec: JobSpec, labels: Mapping[str, str]) -> dict[str, Any]:
    """A rank pod's labels (the template's, then ours) and annotations (the template's)."""
    template_meta = spec.template.get("metadata") or {}
    return {
        "labels": {**(template_meta.get("labels") or {}), **labels},
        "annotations": dict(template_meta.get("annotations") or {}),
    }


def build_pytorchjob(
    body: dict[str, Any],
    spec: JobSpec,
    *,
    uri: str,
    attempt: int,
    world_size: int,
    avoid: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The same attempt as a Kubeflow PyTorchJob: its controller creates the pods and
    sets MASTER_ADDR (its headless Service ``<name>-master-0``), MASTER_PORT (the port
    named ``pytorchjob-port``: fresh per attempt, as ours), WORLD_SIZE and RANK.

    The controller only runs the attempt; ending it is ours, as for our own pods. No
    restarts (restartPolicy Never: one failed pod fails the PyTorchJob) and cleanPodPolicy
    None, so a failed rank's pod stays to be read (a crash, or a peer of a lost node?)
    until the operator deletes the PyTorchJob and, gracefully or by force, the pods. No
    backoffLimit: on exceeding one, the controller deletes every pod before it marks the
    job Failed (cleanPodPolicy is only honoured for a finished job), and the pods that
    tell a crash from a lost node would be gone."""
    job = body["metadata"]["name"]
    pod_spec = _trainer_pod_spec(spec, uri, [{"name": Env.ATTEMPT, "value": str(attempt)}])
    trainer = pod_spec["containers"][0]
    trainer["name"] = "pytorch"  # the name PyTorchJob requires
    ports = [p for p in trainer.get("ports") or [] if p.get("name") != KF_PORT_NAME]
    trainer["ports"] = ports + [{"name": KF_PORT_NAME, "containerPort": master_port(attempt)}]
    # the controller's per-pod headless Services are named like the pods
    peers = [f"{rank_pod_name(spec, job, attempt, r)}:{CACHE_PORT}" for r in range(world_size)]
    _node_cache(pod_spec, spec, body, peers)
    _place(pod_spec, job, avoid)
    labels = {LABEL_JOB: job, LABEL_ATTEMPT: str(attempt), LABEL_WORLD: str(world_size)}
    replicas: dict[str, Any] = {}
    for kind, count, rank in (("Master", 1, 0), ("Worker", world_size - 1, None)):
        if count < 1:
            continue
        kind_spec = copy.deepcopy(pod_spec)
        _merge_env(kind_spec["initContainers"][-1], _heartbeat_env(body, attempt, rank))
        replicas[kind] = {
            "replicas": count,
            "restartPolicy": "Never",
            "template": {"metadata": _pod_metadata(spec, labels), "spec": kind_spec},
        }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": attempt_name(job, attempt),
            "labels": labels,
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "nprocPerNode": str(spec.nproc_per_node),
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }


def build_trainjob(
    body: dict[str, Any],
    spec: JobSpec,
    *,
    uri: str,
    attempt: int,
    world_size: int,
    avoid: tuple[str, ...] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same attempt as a Kubeflow Trainer v2 TrainJob, and the TrainingRuntime it runs:
    (runtime, trainjob), both ``<job>-a<attempt>`` and owned by the job.

    The runtime is the attempt's own, not a shared ClusterTrainingRuntime: a TrainJob can
    only patch the env, mounts and security context of containers its runtime already
    has, and each rank's pod is ours whole (the sidecar, the user's template, the node
    cache's peers and the attempt's fresh port). Trainer makes it a JobSet of one Indexed
    Job of ``world_size`` pods; each pod's completion index is its node rank, which the
    environment reads through the downward API. No torch ML policy: it would fix
    MASTER_PORT at 29400 for every attempt; the environment is the one our pods get.

    As for a PyTorchJob, ending the attempt is the operator's: ``backoffLimitPerIndex: 0``
    (and so podReplacementPolicy Failed) makes the Job controller replace no pod and keep
    the other ranks running when one fails, so that its peers are judged like ours (a
    crash, or a lost node?) until the operator deletes the TrainJob."""
    job = body["metadata"]["name"]
    name = attempt_name(job, attempt)
    hosts = [trainjob_hostname(job, attempt, r) for r in range(world_size)]
    place = Assignment(
        attempt=attempt,
        node_rank=0,
        world_size=world_size,
        nproc_per_node=spec.nproc_per_node,
        master_addr=f"{hosts[0]}.{name}",
        master_port=master_port(attempt),
    )
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{JOB_COMPLETION_INDEX}']"}}
    # RANK counts processes: the node rank only with one per pod (torchrun sets each
    # process's own where there are more)
    per_rank = (Env.NODE_RANK, "PET_NODE_RANK", "RANK")
    env: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in place.environment().items() if k not in per_rank
    ]
    by_index = per_rank if spec.nproc_per_node == 1 else per_rank[:2]
    env += [{"name": k, "valueFrom": index} for k in by_index]
    pod_spec = _trainer_pod_spec(spec, uri, env)
    pod_spec["containers"][0]["name"] = TRAINJOB_CONTAINER
    _node_cache(pod_spec, spec, body, [f"{host}.{name}:{CACHE_PORT}" for host in hosts])
    _merge_env(
        pod_spec["initContainers"][-1],
        _heartbeat_env(body, attempt, None) + [{"name": Env.NODE_RANK, "valueFrom": index}],
    )
    _place(pod_spec, job, avoid)
    labels = {LABEL_JOB: job, LABEL_ATTEMPT: str(attempt), LABEL_WORLD: str(world_size)}
    meta = {"name": name, "labels": labels, "ownerReferences": [owner_reference(body)]}
    indexed_job = {
        "completionMode": "Indexed",
        "backoffLimitPerIndex": 0,
        "podReplacementPolicy": "Failed",
        "template": {"metadata": _pod_metadata(spec, labels), "spec": pod_spec},
    }
    runtime = {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "TrainingRuntime",
        "metadata": meta,
        "spec": {
            "mlPolicy": {"numNodes": world_size},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": TRAINJOB_REPLICATED_JOB,
                            "replicas": 1,
                            "template": {
                                "metadata": {"labels": {TRAINJOB_ANCESTOR: "trainer"}},
                                "spec": indexed_job,
                            },
                        }
                    ]
                }
            },
        },
    }
    trainjob = {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "TrainJob",
        "metadata": copy.deepcopy(meta),
        "spec": {
            "runtimeRef": {"name": name, "apiGroup": TRAINER_GROUP, "kind": "TrainingRuntime"},
            "trainer": {"numNodes": world_size},
        },
    }
    return runtime, trainjob


def controller_failure(obj: Mapping[str, Any]) -> str:
    """Why the controller that runs the attempt (Kubeflow's, for a PyTorchJob or a
    TrainJob) failed it: its Failed condition ("" while it has not)."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            name = (obj.get("metadata") or {}).get("name", "")
            why = c.get("message") or c.get("reason") or "no reason given"
            return f"{obj.get('kind', 'The attempt')} {name} failed: {why}"
    return ""
