"""The CheckpointedTrainingJob spec as typed, validated values.

The API server already refuses a spec that cannot work (the CRD's schema and CEL
rules: ranges, replicas within min and max, the heartbeat timeout, a container in the
template, the pod template as a PodTemplateSpec). The same rules are checked here, with
messages that name the field, for a job stored before the CRD had them: it fails with a
clear condition instead of a loop.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from typing import Any

from ctj_contract import NODE_AGENT_PORT

from .quantities import parse_quantity
from .queue import PRIORITY_LABEL, QUEUE_LABEL


class SpecError(ValueError):
    """The spec cannot work; the message names the field and the fix."""


class Backend(enum.StrEnum):
    """Who makes a job's pods."""

    PODS = "pods"  # the operator itself, with a headless Service
    PYTORCHJOB = "pytorchjob"  # Kubeflow's v1 PyTorchJob controller (legacy: use trainjob)
    TRAINJOB = "trainjob"  # Kubeflow Trainer v2: a TrainJob, run by JobSet


_DRIVER = re.compile(r"(?=.{1,63}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


@dataclasses.dataclass(frozen=True, slots=True)
class NodeCache:
    """The node tier is installed: a node agent (the chart's DaemonSet) on every node holds
    the chunk cache, bounded per node across all jobs, and the pods reach it at their node's
    address on ``port`` (its hostPort). The operator's --node-agent-port says so (unset: no
    agent, no node cache); a job may turn it off with spec.checkpoint.nodeCache.enabled."""

    port: int = NODE_AGENT_PORT
    driver: str | None = None
    """The agents' CSI driver (the chart's CSIDriver, ``ctj_contract.NODE_CACHE_DRIVER``):
    the trainer mounts its job's directory read-only and reads its node's chunks there.
    None: every read goes to the agent over HTTP."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise SpecError(f"node agent port {self.port} is not a TCP port (1-65535)")
        if self.driver is not None and not _DRIVER.fullmatch(self.driver):
            raise SpecError(
                f"node cache CSI driver {self.driver!r} is not a CSI driver name "
                "(a DNS name of at most 63 characters, e.g. node-cache.ctj.dev)"
            )


def _backend(raw: object) -> Backend:
    try:
        return Backend(str(raw))
    except ValueError:
        choices = " or ".join(b.value for b in Backend)
        raise SpecError(f"spec.backend={raw!r}: use {choices}") from None


def _node_cache(raw: dict[str, Any], default: NodeCache | None) -> NodeCache | None:
    """A job's node cache: the operator's (where the node agent is installed), unless the
    job turns it off. ``sizeLimit`` is still accepted and checked, but the agent bounds the
    cache per node across all jobs (the chart's nodeAgent.maxBytes), not per job."""
    if default is None or raw.get("enabled", True) is False:
        return None
    if "sizeLimit" in raw:
        try:
            parse_quantity(str(raw["sizeLimit"]))
        except ValueError:
            raise SpecError(
                f"spec.checkpoint.nodeCache.sizeLimit={raw['sizeLimit']!r} is not a quantity: "
                "use e.g. 20Gi"
            ) from None
    return default


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSpec:
    uri: str
    endpoint: str | None = None
    credentials_secret: str | None = None
    interval_steps: int = 100
    mode: str = "incremental"
    full_every: int = 10
    keep_last: int = 3
    sidecar_image: str | None = None
    sidecar_resources: dict[str, Any] | None = None
    staging_size_limit: str = "8Gi"
    node_cache: NodeCache | None = None
    resume_from: str | None = None
    """Seed from another job's checkpoints: a location URI or a job's name (``ResumeSource``)."""

    def __post_init__(self) -> None:
        if self.resume_from is not None:
            _resume_from(self.resume_from)  # raises SpecError naming the field


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DetectionSpec:
    """How fast an attempt is declared over (docs/operator.md, "Failure detection")."""

    heartbeat_period_seconds: float = 1.0  # the operator asks each rank's sidecar this often
    heartbeat_timeout_seconds: float = 3.0  # a rank (or its trainer) silent this long failed
    scheduling_timeout_seconds: float = 300.0  # ranks Pending this long end the attempt
    teardown_deadline_seconds: float = 45.0  # then an ended attempt's pods are force-deleted

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_seconds < 3 * self.heartbeat_period_seconds:
            raise SpecError(
                f"spec.failureDetection.heartbeatTimeoutSeconds={self.heartbeat_timeout_seconds:g}"
                " must be at least 3 heartbeatPeriodSeconds "
                f"({self.heartbeat_period_seconds:g}): one late beat must not fail a job"
            )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    replicas: int
    min_replicas: int
    max_replicas: int
    nproc_per_node: int
    backend: Backend
    template: dict[str, Any]
    checkpoint: CheckpointSpec
    max_restarts: int = 10
    backoff_seconds: float = 2.0
    reset_after_seconds: float = 600.0  # crashes are forgiven after this long healthy
    spares: int = 0
    """Warm spares kept running beside the ranks (spec.spares); needs ``relaunches``."""
    in_place: bool = True
    """restartPolicy.inPlace: survivors keep their pods across an unplanned restart (where
    ``relaunches``)."""
    scale_up: bool = True
    stabilization_seconds: float = 60.0
    detection: DetectionSpec = dataclasses.field(default_factory=lambda: DetectionSpec())
    transition_timeout_seconds: float = 120.0  # a planned transition waits this for its save
    active_deadline_seconds: int | None = None
    """The job fails (DeadlineExceeded) this long after status.startTime; None: never."""
    ttl_seconds_after_finished: int | None = None
    """A finished job is deleted this long after it finished; None: never."""
    suspend: bool = False
    """spec.suspend: the running attempt checkpoints at its next step boundary and stops,
    and no attempt starts until it is false again (then resumed from that step)."""
    queue: str | None = None
    """The Kueue LocalQueue that admits the job (its kueue.x-k8s.io/queue-name label)."""
    priority_class: str | None = None
    """Its Kueue WorkloadPriorityClass (its kueue.x-k8s.io/priority-class label)."""

    def __post_init__(self) -> None:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise SpecError(
                f"spec.replicas={self.replicas} must be within spec.minReplicas="
                f"{self.min_replicas} and spec.maxReplicas={self.max_replicas}"
            )
        if self.active_deadline_seconds is not None and self.active_deadline_seconds < 1:
            raise SpecError(
                f"spec.activeDeadlineSeconds={self.active_deadline_seconds} must be at least 1:"
                " omit it for no deadline"
            )
        if self.ttl_seconds_after_finished is not None and self.ttl_seconds_after_finished < 0:
            raise SpecError(
                f"spec.ttlSecondsAfterFinished={self.ttl_seconds_after_finished} must be 0 or"
                " more: omit it to keep a finished job"
            )
        containers = (self.template.get("spec") or {}).get("containers") or []
        if not containers:
            raise SpecError("spec.template.spec.containers is empty: add the trainer container")
        object.__setattr__(self, "backend", _backend(self.backend))
        if self.spares and self.queue:
            raise SpecError(
                f"spec.spares={self.spares} with the kueue.x-k8s.io/queue-name label: Kueue "
                "admits the ranks only, and a spare would run outside its quota; set spec.spares: 0"
            )
        if self.spares and not self.relaunches:
            raise SpecError(
                f"spec.spares={self.spares} needs in-place restart: backend pods, the trainer "
                "container's command set, restartPolicy.inPlace true; or set spec.spares: 0"
            )

    @property
    def relaunches(self) -> bool:
        """Its pods run the ctj launcher, so a survivor's worker restarts in place: asked
        for (restartPolicy.inPlace), our own pods (a PyTorchJob's are its controller's),
        and a trainer command to wrap (an image's entrypoint cannot be)."""
        trainer = (self.template.get("spec") or {}).get("containers", [{}])[0]
        return self.in_place and self.backend == Backend.PODS and bool(trainer.get("command"))

    @classmethod
    def parse(
        cls,
        spec: dict[str, Any],
        *,
        sidecar_image: str | None = None,
        node_cache: NodeCache | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> JobSpec:
        """``sidecar_image``, ``node_cache``: the operator's defaults; ``labels``: the
        job's (a Kueue queue and priority class)."""
        labels = labels or {}
        ck = spec.get("checkpoint") or {}
        if not ck.get("uri"):
            raise SpecError("spec.checkpoint.uri is missing: set s3://bucket/prefix")
        restart = spec.get("restartPolicy") or {}
        scale = spec.get("scaleUp") or {}
        detect = spec.get("failureDetection") or {}
        transitions = spec.get("transitions") or {}
        return cls(
            replicas=int(spec.get("replicas", 1)),
            min_replicas=int(spec.get("minReplicas", 1)),
            max_replicas=int(spec.get("maxReplicas", 64)),
            nproc_per_node=int(spec.get("nprocPerNode", 1)),
            backend=_backend(spec.get("backend", "pods")),
            template=dict(spec.get("template") or {}),
            checkpoint=CheckpointSpec(
                uri=str(ck["uri"]),
                endpoint=ck.get("endpoint") or None,
                credentials_secret=ck.get("credentialsSecret") or None,
                interval_steps=int(ck.get("intervalSteps", 100)),
                mode=str(ck.get("mode", "incremental")),
                full_every=int(ck.get("fullEvery", 10)),
                keep_last=int(ck.get("keepLast", 3)),
                sidecar_image=ck.get("sidecarImage") or sidecar_image,
                sidecar_resources=ck.get("sidecarResources") or None,
                staging_size_limit=str(ck.get("stagingSizeLimit", "8Gi")),
                node_cache=_node_cache(dict(ck.get("nodeCache") or {}), node_cache),
                resume_from=ck.get("resumeFrom") or None,
            ),
            max_restarts=int(restart.get("maxRestarts", 10)),
            backoff_seconds=float(restart.get("backoffSeconds", 2.0)),
            reset_after_seconds=float(restart.get("resetAfterSeconds", 600.0)),
            in_place=bool(restart.get("inPlace", True)),
            spares=int(spec.get("spares", 0)),
            scale_up=bool(scale.get("enabled", True)),
            stabilization_seconds=float(scale.get("stabilizationSeconds", 60.0)),
            detection=DetectionSpec(
                heartbeat_period_seconds=float(detect.get("heartbeatPeriodSeconds", 1.0)),
                heartbeat_timeout_seconds=float(detect.get("heartbeatTimeoutSeconds", 3.0)),
                scheduling_timeout_seconds=float(detect.get("schedulingTimeoutSeconds", 300.0)),
                teardown_deadline_seconds=float(detect.get("teardownDeadlineSeconds", 45.0)),
            ),
            transition_timeout_seconds=float(transitions.get("checkpointTimeoutSeconds", 120.0)),
            active_deadline_seconds=_optional_int(spec.get("activeDeadlineSeconds")),
            ttl_seconds_after_finished=_optional_int(spec.get("ttlSecondsAfterFinished")),
            suspend=bool(spec.get("suspend", False)),
            queue=labels.get(QUEUE_LABEL) or None,
            priority_class=labels.get(PRIORITY_LABEL) or None,
        )


def _optional_int(raw: object) -> int | None:
    return None if raw is None else int(str(raw))


def job_checkpoint_uri(spec: JobSpec, namespace: str, name: str, uid: str) -> str:
    """One location per job instance: <uri>/<namespace>/<name>-<uid>."""
    return f"{spec.checkpoint.uri.rstrip('/')}/{namespace}/{name}-{uid}"


# the CRD's patterns for spec.checkpoint.uri and for a job's name (metadata.name: a DNS-1123
# subdomain); tests/unit/test_resume_from_spec.py keeps these and the CRD's in step
URI_PATTERN = re.compile(
    r"(s3://[A-Za-z0-9._-]+(/[^/?#@]*[^/?#@.][^/?#@]*)*/?|file://(localhost)?/[^?#]*)"
)
NAME_PATTERN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclasses.dataclass(frozen=True, slots=True)
class ResumeSource:
    """Where a job with no checkpoint of its own is seeded from (spec.checkpoint.resumeFrom).

    ``uri`` alone: one checkpoint location (``kubectl get ctj OLD -o
    jsonpath='{.status.storage.uri}'``, or a path ``ctj checkpoints ls`` shows). ``uri`` and
    ``job``: the directory of the namespace's locations under the job's own
    ``spec.checkpoint.uri``, and the name whose locations (``<job>-<uid>``, one per uid the
    name had) the trainer looks through: it picks the newest commit among them, since a
    deleted job's uid is known to nobody (the operator holds no S3 credentials and cannot
    list; docs/operator.md, "Resume from another job")."""

    uri: str
    job: str | None = None


def _resume_from(raw: str) -> str:
    if "://" in raw:
        if not URI_PATTERN.fullmatch(raw):
            raise SpecError(
                f"spec.checkpoint.resumeFrom={raw!r} is not a checkpoint location: use "
                "s3://bucket/prefix/<namespace>/<job>-<uid> (the old job's status.storage.uri) "
                "or the old job's name"
            )
    elif len(raw) > 253 or not NAME_PATTERN.fullmatch(raw):
        raise SpecError(
            f"spec.checkpoint.resumeFrom={raw!r} is neither a URI nor a job's name: use the "
            "old job's name (lowercase letters, digits, '-', '.') or its s3:// location"
        )
    return raw


def resume_source(spec: JobSpec, location: str) -> ResumeSource | None:
    """What the trainer seeds from, if the job has no checkpoint of its own (pure).
    ``location``: the job's own (``job_checkpoint_uri``, or status.storage): a job named
    in resumeFrom has its locations beside it, ``<uri>/<namespace>/<name>-<uid>``."""
    raw = spec.checkpoint.resume_from
    if raw is None:
        return None
    if "://" in _resume_from(raw):
        return ResumeSource(raw)
    return ResumeSource(location.rstrip("/").rsplit("/", 1)[0], job=raw)
