"""Render: each action of a ``Plan`` as the exact API requests that carry it out.

Pure, like ``decide`` and the builders it calls: a ``Call`` names the verb, the kind, the
object and the body to send; apply.py sends them in order and knows each verb's
idempotence rule (an object already there, or already gone, is success). Metrics-only
actions (Restarted, Recovered) render to no call.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping
from typing import Any

from ctj_contract import GROUP, KIND, LABEL_JOB, LABEL_SPARE, VERSION

from . import builders, queue
from .decisions import (
    Action,
    CreateAttempt,
    CreateSpares,
    CreateWorkload,
    DeleteAttempt,
    DeleteJob,
    DeletePods,
    DeleteWorkload,
    Emit,
    PatchStatus,
    PatchWorkload,
    Plan,
    Recovered,
    RequestCheckpoint,
    Restarted,
)
from .network_policy import NetworkPolicyParams, build_network_policy
from .spec import Backend, JobSpec

POD_GRACE_SECONDS = 30


class Verb(enum.StrEnum):
    CREATE = "create"  # already there (409) is success
    PATCH = "patch"  # a pod's labels (kept for the next attempt); already gone (404) is success
    PATCH_STATUS = "patch-status"  # the job's .status, conditional on the version read
    DELETE = "delete"  # already gone (404) is success; the job itself: only if unchanged
    EVENT = "event"  # a Kubernetes Event about the job
    STATUS = "status"  # another object's .status (a Workload's), conditional on its version


class Kind(enum.StrEnum):
    POD = "Pod"
    SERVICE = "Service"
    SECRET = "Secret"
    NETWORK_POLICY = "NetworkPolicy"
    PYTORCHJOB = "PyTorchJob"
    TRAINJOB = "TrainJob"  # Kubeflow Trainer v2's
    TRAINING_RUNTIME = "TrainingRuntime"  # the TrainJob's own runtime
    WORKLOAD = "Workload"  # Kueue's
    JOB = KIND


ATTEMPT_KINDS = {Backend.PYTORCHJOB: Kind.PYTORCHJOB, Backend.TRAINJOB: Kind.TRAINJOB}
"""The object that runs an attempt of each backend of builders.CONTROLLED."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One request to the API server."""

    verb: Verb
    kind: Kind
    namespace: str
    name: str = ""
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    grace_seconds: int | None = None  # DELETE of a pod


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """The job a plan is rendered for."""

    body: Mapping[str, Any]
    """The job as read: its name, namespace and uid (owner references, Events)."""
    spec: JobSpec | None
    """None where the spec is invalid: only status writes and Events render then."""
    uri: str = ""
    cache_token: str = dataclasses.field(default="", repr=False)
    """The job's token (ctj_contract.tokens), for its Secret should it be made."""
    network_policy: NetworkPolicyParams | None = None
    """What the job's NetworkPolicy lets in; None: the operator makes none."""

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    def job_spec(self) -> JobSpec:
        if self.spec is None:
            raise ValueError(f"{self.namespace}/{self.name}: no valid spec to render with")
        return self.spec


Rendered = tuple[tuple[Action, tuple[Call, ...]], ...]
"""Each action of a plan with its calls, in the plan's order."""


def render_plan(plan: Plan, target: Target) -> Rendered:
    return tuple((action, render(action, target)) for action in plan.actions)


@functools.singledispatch
def render(action: Action, target: Target) -> tuple[Call, ...]:
    raise TypeError(f"no rendering for {type(action).__name__}")


@render.register
def _(action: PatchStatus, target: Target) -> tuple[Call, ...]:
    if action.conditions is not None:  # a write's condition changes are not a patch yet
        raise ValueError("a status write's conditions go through conditions.written first")
    body = {"status": dict(action.fields)}
    return (
        Call(
            verb=Verb.PATCH_STATUS,
            kind=Kind.JOB,
            namespace=target.namespace,
            name=target.name,
            body=body,
        ),
    )


@render.register
def _(action: CreateAttempt, target: Target) -> tuple[Call, ...]:
    """The job's Secret first (its token: made once per job, kept across attempts; the
    pods read it) and its NetworkPolicy (before any pod, so none runs unguarded), then the
    PyTorchJob, or the Service and the pods."""
    spec, body, ns = target.job_spec(), dict(target.body), target.namespace
    attempt, world_size, uri, avoid = action.attempt, action.world_size, target.uri, action.avoid
    if action.node_labels or action.tolerations:  # where Kueue admitted the job
        placed = builders.placed(spec.template, action.node_labels, action.tolerations)
        spec = dataclasses.replace(spec, template=placed)

    def create(kind: Kind, obj: Mapping[str, Any]) -> Call:
        return Call(verb=Verb.CREATE, kind=kind, namespace=ns, body=obj)

    calls = [create(Kind.SECRET, builders.build_cache_secret(body, target.cache_token))]
    if target.network_policy is not None:
        policy = build_network_policy(body, target.network_policy)
        calls.append(create(Kind.NETWORK_POLICY, policy))
    if spec.backend == Backend.PYTORCHJOB:
        job = builders.build_pytorchjob(
            body, spec, uri=uri, attempt=attempt, world_size=world_size, avoid=avoid
        )
        return (*calls, create(Kind.PYTORCHJOB, job))
    if spec.backend == Backend.TRAINJOB:  # the runtime first: the TrainJob's webhook reads it
        runtime, trainjob = builders.build_trainjob(
            body, spec, uri=uri, attempt=attempt, world_size=world_size, avoid=avoid
        )
        return (*calls, create(Kind.TRAINING_RUNTIME, runtime), create(Kind.TRAINJOB, trainjob))
    calls.append(create(Kind.SERVICE, builders.build_service(body)))
    carried = action.carried
    for rank, pod_name in enumerate(carried):  # before any create: the anti-affinity sees them
        labels: dict[str, str | None] = {
            **builders.rank_labels(target.name, attempt, rank, world_size),
            LABEL_SPARE: None,  # a spare taking a rank is one no more
        }
        patch = {"metadata": {"labels": labels}}
        calls.append(Call(verb=Verb.PATCH, kind=Kind.POD, namespace=ns, name=pod_name, body=patch))
    for rank in range(len(carried), world_size):
        pod = builders.build_pod(
            body, spec, uri=uri, attempt=attempt, world_size=world_size, node_rank=rank,
            avoid=avoid, names=carried,
        )  # fmt: skip
        calls.append(create(Kind.POD, pod))
    return tuple(calls)


@render.register
def _(action: CreateSpares, target: Target) -> tuple[Call, ...]:
    spec, body, ns = target.job_spec(), dict(target.body), target.namespace
    return tuple(
        Call(
            verb=Verb.CREATE,
            kind=Kind.POD,
            namespace=ns,
            body=builders.build_spare(
                body, spec, uri=target.uri, name=name, peers=action.peers, avoid=action.avoid
            ),
        )
        for name in action.names
    )


@render.register
def _(action: DeletePods, target: Target) -> tuple[Call, ...]:
    grace = 0 if action.force else POD_GRACE_SECONDS
    return tuple(
        Call(
            verb=Verb.DELETE,
            kind=Kind.POD,
            namespace=target.namespace,
            name=pod,
            grace_seconds=grace,
        )
        for pod in action.names
    )


@render.register
def _(action: DeleteAttempt, target: Target) -> tuple[Call, ...]:
    """The ended attempt's PyTorchJob, or TrainJob and its runtime (their pods go with
    them); our own pods are deleted by ``DeletePods``."""
    if target.spec is None or target.spec.backend not in ATTEMPT_KINDS:
        return ()
    name = builders.attempt_name(target.name, action.attempt)
    kinds = [ATTEMPT_KINDS[target.spec.backend]]
    if target.spec.backend == Backend.TRAINJOB:
        kinds.append(Kind.TRAINING_RUNTIME)
    return tuple(
        Call(verb=Verb.DELETE, kind=kind, namespace=target.namespace, name=name) for kind in kinds
    )


@render.register
def _(action: DeleteJob, target: Target) -> tuple[Call, ...]:
    """The job, only if it is still the one read: its uid here, the resourceVersion the
    plan was made from added by apply (a job edited since, e.g. its TTL raised, stays)."""
    uid = target.body["metadata"]["uid"]
    return (
        Call(
            verb=Verb.DELETE,
            kind=Kind.JOB,
            namespace=target.namespace,
            name=target.name,
            body={"preconditions": {"uid": uid}},
        ),
    )


@render.register
def _(action: RequestCheckpoint | Restarted | Recovered, target: Target) -> tuple[Call, ...]:
    """No request: a checkpoint request is in the status the plan writes first, and the
    heartbeat channel (heartbeats.py) carries it to every rank from there; Restarted and
    Recovered are metrics only (metrics.OperatorMetrics.record)."""
    return ()


@render.register
def _(action: CreateWorkload, target: Target) -> tuple[Call, ...]:
    """The pod set's template is a rank's pod as it will be made (its sidecar and every
    request, which is what Kueue counts against the quota)."""
    spec, body = target.job_spec(), dict(target.body)
    pod = builders.build_pod(body, spec, uri=target.uri, attempt=0, world_size=action.count,
                             node_rank=0)  # fmt: skip
    workload = queue.build_workload(
        builders.owner_reference(body),
        namespace=target.namespace,
        queue=spec.queue or "",
        count=action.count,
        min_count=action.min_count,
        pod_spec=pod["spec"],
        priority=action.priority,
        labels={LABEL_JOB: target.name},
    )
    return (Call(verb=Verb.CREATE, kind=Kind.WORKLOAD, namespace=target.namespace, body=workload),)


@render.register
def _(action: PatchWorkload, target: Target) -> tuple[Call, ...]:
    workload = action.workload
    status = queue.status_patch(workload, action.write, action.message, action.now)
    body = {"metadata": {"resourceVersion": workload.resource_version}, "status": status}
    return (Call(verb=Verb.STATUS, kind=Kind.WORKLOAD, namespace=target.namespace,
                 name=workload.name, body=body),)  # fmt: skip


@render.register
def _(action: DeleteWorkload, target: Target) -> tuple[Call, ...]:
    return (Call(verb=Verb.DELETE, kind=Kind.WORKLOAD, namespace=target.namespace,
                 name=action.name),)  # fmt: skip


@render.register
def _(action: Emit, target: Target) -> tuple[Call, ...]:
    meta = target.body["metadata"]
    about = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid")},
    }
    event = {
        "object": about,
        "type": action.type,
        "reason": action.reason,
        "message": action.message,
    }
    return (
        Call(
            verb=Verb.EVENT, kind=Kind.JOB, namespace=target.namespace, name=target.name, body=event
        ),
    )
