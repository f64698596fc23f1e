"""Pure decisions of the operator: how many nodes, when to restart, grow, succeed or fail.

``decide`` takes what the reconciler observed (the job's spec and status, its
pods, the nodes) and returns one Decision. It does no I/O and reads no clock:
``now`` is passed in. Every rule is table-tested in tests/unit/test_decisions.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .spec import JobSpec

MAX_BACKOFF_S = 300.0


@dataclasses.dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    ready: bool
    schedulable: bool  # not cordoned, no NoSchedule/NoExecute taint


@dataclasses.dataclass(frozen=True, slots=True)
class PodView:
    name: str
    node_rank: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    node_name: str | None
    terminating: bool = False
    reason: str | None = None  # e.g. Evicted


@dataclasses.dataclass(frozen=True, slots=True)
class JobState:
    """The part of .status the decisions depend on."""

    phase: str = "Pending"
    attempt: int = 0
    world_size: int = 0
    restarts: int = 0
    pods_created: bool = False  # every pod of the attempt was created (so a missing one died)
    not_before: float | None = None  # backoff: no new attempt before this time
    capacity_since: float | None = None  # since when more nodes than world_size are usable


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    action: str  # none | wait | start | create_pods | restart | succeed | fail
    world_size: int = 0
    reason: str = ""
    message: str = ""
    counts_as_failure: bool = False
    requeue_after: float | None = None
    capacity_since: float | None = None  # the new value to record
    not_before: float | None = None  # restart: no new attempt before this time (backoff)


def usable_nodes(nodes: Sequence[NodeView]) -> int:
    return sum(1 for n in nodes if n.ready and n.schedulable)


def backoff(spec: JobSpec, restarts: int) -> float:
    """Restart delay after the n-th failure: doubles from backoffSeconds, capped at 5 min."""
    return min(MAX_BACKOFF_S, spec.backoff_seconds * (2 ** min(restarts, 16)))


def attempt_failure(
    pods: Sequence[PodView], nodes: Sequence[NodeView], world_size: int
) -> tuple[str, str] | None:
    """Why the running attempt is over, as (reason, message); None while it is healthy."""
    by_name = {n.name: n for n in nodes}
    present = {p.node_rank for p in pods}
    missing = sorted(set(range(world_size)) - present)
    if missing:
        return "PodDeleted", f"pod of node rank {missing[0]} is gone"
    for p in sorted(pods, key=lambda p: p.node_rank):
        if p.phase == "Failed":
            if p.reason == "Evicted":
                return "PodEvicted", f"pod {p.name} was evicted"
            return "PodFailed", f"pod {p.name} failed" + (f" ({p.reason})" if p.reason else "")
        if p.terminating and p.phase != "Succeeded":
            return "PodDeleted", f"pod {p.name} is being deleted"
        if p.node_name is None:
            continue
        node = by_name.get(p.node_name)
        if node is None:
            return "NodeDeleted", f"node {p.node_name} of pod {p.name} was deleted"
        if not node.ready and p.phase != "Succeeded":
            return "NodeNotReady", f"node {p.node_name} of pod {p.name} is not ready"
        if not node.schedulable and p.phase != "Succeeded":
            return "NodeCordoned", f"node {p.node_name} of pod {p.name} was cordoned"
    return None


def lingering_pods(pods: Sequence[PodView], nodes: Sequence[NodeView]) -> list[PodView]:
    """Pods of the ended attempt still on a live node: the new gang waits for them.

    They hold the node's ports and accelerators, and their node is the only proof that
    it is alive: a node lost a moment ago still reads Ready until its grace period ends,
    and counting it would start the new attempt too wide. A pod on a NotReady or deleted
    node never finishes terminating, so it does not hold the start back.
    """
    ready = {n.name for n in nodes if n.ready}
    return [p for p in pods if p.node_name is not None and p.node_name in ready]


def decide(
    spec: JobSpec,
    state: JobState,
    pods: Sequence[PodView],
    nodes: Sequence[NodeView],
    now: float,
) -> Decision:
    if state.phase in ("Succeeded", "Failed"):
        return Decision("none")
    usable = usable_nodes(nodes)
    target = min(spec.replicas, spec.max_replicas, usable)

    # no live attempt: start one when allowed and there are enough nodes
    if state.attempt == 0 or state.phase == "Restarting":
        if state.not_before is not None and now < state.not_before:
            return Decision("wait", requeue_after=state.not_before - now)
        lingering = lingering_pods(pods, nodes)
        if lingering:
            return Decision(
                "wait",
                reason="TearingDown",
                message=f"{len(lingering)} pods of attempt {state.attempt} still terminating "
                f"(first: {lingering[0].name})",
                requeue_after=1.0,
            )
        if target < spec.min_replicas:
            return Decision(
                "wait",
                reason="InsufficientNodes",
                message=f"{usable} usable nodes; the job needs at least {spec.min_replicas}",
                requeue_after=5.0,
            )
        return Decision(
            "start",
            world_size=target,
            reason="Started",
            message=f"attempt {state.attempt + 1} at world size {target}",
        )

    if not state.pods_created:  # the operator stopped while creating this attempt's pods
        return Decision("create_pods", world_size=state.world_size)

    failure = attempt_failure(pods, nodes, state.world_size)
    if failure is not None:
        reason, message = failure
        if state.restarts >= spec.max_restarts:
            return Decision(
                "fail",
                reason="MaxRestartsExceeded",
                message=f"{message}; giving up after {state.restarts} restarts "
                f"(spec.restartPolicy.maxRestarts={spec.max_restarts})",
            )
        return Decision(
            "restart",
            reason=reason,
            message=message,
            counts_as_failure=True,
            not_before=now + backoff(spec, state.restarts),
        )

    if pods and all(p.phase == "Succeeded" for p in pods):
        return Decision("succeed", reason="Completed", message="every rank exited 0")

    if spec.replicas < state.world_size:
        return Decision(
            "restart",
            reason="Resize",
            message=f"spec.replicas {spec.replicas} < world size {state.world_size}",
        )
    if target > state.world_size and spec.scale_up:
        since = state.capacity_since if state.capacity_since is not None else now
        if now - since >= spec.stabilization_seconds:
            return Decision(
                "restart",
                reason="ScaleUp",
                message=f"{usable} usable nodes for {now - since:.0f}s: "
                f"growing from {state.world_size} to {target}",
            )
        return Decision(
            "wait", capacity_since=since, requeue_after=spec.stabilization_seconds - (now - since)
        )
    return Decision("none", capacity_since=None)
