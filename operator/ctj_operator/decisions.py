"""Pure decisions of the operator: every action a reconcile takes, decided in one place.

``decide`` takes one ``Observation`` (the job's spec and status as last read, its pods of
every attempt, the nodes, where a rank fits, each rank's heartbeat, the clock) and returns
a ``Plan``: the status writes, pod deletions, attempt creations, checkpoint requests and
Events the handler applies in order, and nothing else. It does no I/O and reads no clock.
Every rule is table-tested in tests/unit/test_decisions.py; docs/operator.md states them.

Two rules guard against a lagging view of the cluster:
- a pod of an attempt newer than the one read means the view is stale: the plan is empty;
- every plan that creates or deletes begins with a status write, which the handler sends
  with the resourceVersion it read, so a stale plan fails on its first write and acts on
  nothing (deleting pods of attempts older than the one read is safe in any view).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from ctj_contract import Condition, Phase, parse_time, rfc3339

from . import queue as kueue  # its names only: queue.py interprets Kueue's objects
from .builders import spare_name
from .queue import Queue, WorkloadView, Write
from .spec import Backend, JobSpec

MAX_BACKOFF_S = 300.0
UNSEEN_GRACE_S = 30.0
"""A pod missing this soon after its attempt started may only not have reached our watch
yet (the view lags our own creates): it is not judged gone before."""
TERMINAL = ("Succeeded", "Failed")


SUSPEND = "Suspended"
"""The reason of an attempt ended by spec.suspend (a planned end that starts nothing)."""
EVICTED = "Evicted"
"""The reason of an attempt ended because Kueue evicted the job's Workload (a planned
end; the next attempt waits for Kueue to admit the job again)."""
REQUEUED = "Requeued"
"""The reason of an attempt ended because spec.replicas no longer is what the job's Kueue
Workload asks for (a `kubectl scale`): Kueue v0.19 resizes no admission in place for a
kind it does not compile in, so the job stops with a checkpoint, its Workload is made
again at the new size and the next attempt waits for that admission."""
PAUSES = (SUSPEND, EVICTED, REQUEUED)
"""Planned ends that start no attempt by themselves: not restarts."""


class Cause(enum.StrEnum):
    """Why an attempt ended, which decides what it costs the job."""

    CRASH = "crash"  # the job's own failure: counts against maxRestarts, backs off
    NODE = "node"  # the cluster's: a node lost, a pod evicted or deleted, no room
    PLANNED = "planned"  # a resize, a scale-up or a drain: checkpointed first, free


@dataclasses.dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    ready: bool
    cordoned: bool = False
    alive_at: float | None = None  # when its kubelet's Lease was last seen renewed


@dataclasses.dataclass(frozen=True, slots=True)
class PodView:
    name: str
    attempt: int
    node_rank: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    node_name: str | None
    terminating: bool = False
    reason: str | None = None  # e.g. Evicted
    exit: str = ""  # how its trainer ended, e.g. "trainer exited 1: <its last line>"
    waiting: str = ""  # why it is not running yet (the scheduler's message)
    phase_age: float | None = None  # seconds since the operator saw its phase change
    finished: bool = False
    """Its trainer ended (the kubelet is stopping its sidecar, the pod still Running): no
    longer judged by heartbeats, which stop with the sidecar."""
    relaunchable: bool = False
    """The pod runs, under the ctj launcher: it can be kept for the next attempt and its
    worker restarted in place (even where its worker failed: ``phase`` then says Failed)."""
    spare: bool = False
    """A warm spare (spec.spares): of no attempt (``attempt`` 0) until one carries it."""
    avoid: tuple[str, ...] = ()
    """The nodes a spare was made to keep off (suspect then)."""

    @property
    def beating(self) -> bool:
        """Running, on a node, its trainer not ended: a rank whose silence means something."""
        return self.phase == "Running" and self.node_name is not None and not self.finished


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    """A planned end of the attempt: the job was asked to checkpoint and stop."""

    reason: str
    message: str
    requested_at: float
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class JobState:
    """The part of .status the decisions depend on."""

    phase: str = "Pending"
    attempt: int = 0
    world_size: int = 0
    restarts: int = 0  # the job's own crashes (decayed after a healthy period)
    node_restarts: int = 0  # attempts the cluster ended (lost nodes, evictions, no room)
    pods_created: bool = False  # every pod of the attempt was created (so a missing one died)
    torn_down: bool = True  # the ended attempt's PyTorchJob and Leases were deleted
    not_before: float | None = None  # backoff: no new attempt before this time
    capacity_since: float | None = None  # since when more nodes than world_size fit
    attempt_started: float | None = None
    healthy_since: float | None = None  # every rank of this attempt running since
    teardown_since: float | None = None
    failure_seen_at: float | None = None
    size_cap: int | None = None  # the next attempt's width after ranks could not schedule
    suspect: Mapping[str, float] = dataclasses.field(default_factory=dict)
    transition: Transition | None = None
    last_checkpoint: Mapping[str, Any] | None = None
    storage: str | None = None  # the checkpoint location pinned at the first start
    conditions: Sequence[Mapping[str, Any]] = ()
    observed_generation: int = 0  # the spec generation last acted on
    attempt_generation: int = 0  # the spec generation the current attempt was started from
    selector: str = ""  # the scale subresource's label selector, as written
    start_time: float | None = None  # when the operator first took the job up
    survivors: tuple[str, ...] = ()
    """Pods of the ended attempt kept for the next one (their workers restart in place)."""
    carried: tuple[str, ...] = ()
    """Pods of the current attempt kept from the one before, by node rank (0..k-1): their
    names say the attempt that made them."""
    spares: int = 0  # warm spares running, as last written

    def condition(self, kind: Condition) -> Mapping[str, Any]:
        """The condition of type ``kind`` as read ({} where the job has none)."""
        return next((c for c in self.conditions if c.get("type") == kind), {})

    @property
    def finished_at(self) -> float | None:
        """When the job finished: the lastTransitionTime of its Succeeded or Failed
        condition that is True (as Kubernetes' TTL controller reads a Job's), or None."""
        for kind in (Condition.SUCCEEDED, Condition.FAILED):
            found = self.condition(kind)
            if found.get("status") == "True":
                return parse_time(found.get("lastTransitionTime"))
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    spec: JobSpec
    state: JobState
    pods: Sequence[PodView]  # the job's pods, every attempt
    nodes: Sequence[NodeView]
    fits: Sequence[str]  # nodes where one rank fits (capacity.py), other jobs' pods counted
    rejected: str = ""  # why the other nodes do not fit, one line
    beats: Mapping[int, float | None] = dataclasses.field(default_factory=dict)
    """Node rank of the current attempt -> seconds since its heartbeat last changed
    (None: it has not beaten yet)."""
    unanswered: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """Node rank of the current attempt that has not answered a heartbeat yet -> seconds
    since this operator first saw it Running (judged against STARTUP_GRACE_S)."""
    trainers: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """Node rank of the current attempt -> seconds its longest-silent trainer had not run,
    as its sidecar last answered (absent: no liveness pulse, e.g. still importing)."""
    last_checkpoint: Mapping[str, Any] | None = None  # what rank 0's sidecar reports
    uri: str = ""  # the checkpoint location a first start pins
    now: float = 0.0
    controller_failure: str = ""
    """Backends pytorchjob and trainjob: why the Kubeflow controller failed the
    attempt's PyTorchJob or TrainJob ("" while it has not). Read after the pods: they
    tell a crash from a lost node."""
    generation: int = 0
    """The job's metadata.generation as read (0: unknown, nothing is stamped with it)."""
    selector: str = ""
    """The label selector of the job's pods (for the scale subresource)."""
    refused: str = ""
    """Why the API refused an object of the current attempt as it was created (422,
    quota, admission), as the last reconcile's apply reported it; "" where it did not."""
    job: str = ""
    """The job's name (what the spares it makes are named after)."""
    queue: Queue | None = None
    """What Kueue said of the job, where it names a LocalQueue (queue.py)."""


# ---- the actions a plan is made of (handlers.py applies each) ----


@dataclasses.dataclass(frozen=True, slots=True)
class EnterPhase:
    """The phase's condition turns True, the other phases' False (conditions.py)."""

    phase: Phase
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class SetCondition:
    kind: Condition
    status: bool
    reason: str
    message: str
    only_if_true: bool = False
    """Turn False only a condition that is True in the list being written (none is
    added): judged there, not on the status read, because an earlier write of the same
    plan may have just set it (a SpecPending noted on the tick an attempt starts)."""


ConditionChange = EnterPhase | SetCondition


@dataclasses.dataclass(frozen=True, slots=True)
class PatchStatus:
    fields: Mapping[str, Any]
    conditions: tuple[ConditionChange, ...] | None = None
    """What this write changes of ``status.conditions``, made into the exact list by
    conditions.py (metav1.Condition rules, every condition stamped with the generation
    read); (): only re-stamped; None: the write leaves them alone."""


@dataclasses.dataclass(frozen=True, slots=True)
class CreateAttempt:
    """The Service and the pods (or the PyTorchJob, or the TrainJob): ``carried`` pods,
    kept from the attempt before, are relabelled as node ranks 0..k-1 (their launchers
    restart the workers in place), the others created."""

    attempt: int
    world_size: int
    avoid: tuple[str, ...] = ()  # suspect nodes: kept off by node affinity (they read Ready)
    carried: tuple[str, ...] = ()
    node_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """What the admitted Kueue ResourceFlavors add to the pods' nodeSelector."""
    tolerations: tuple[Mapping[str, Any], ...] = ()
    """And to their tolerations."""


@dataclasses.dataclass(frozen=True, slots=True)
class CreateSpares:
    """Warm spares named ``names``; ``peers``: the running attempt's pods by node rank."""

    names: tuple[str, ...]
    peers: tuple[str, ...]
    avoid: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class DeletePods:
    names: tuple[str, ...]
    force: bool = False  # grace 0: for pods whose kubelet is gone, or past the deadline


@dataclasses.dataclass(frozen=True, slots=True)
class DeleteAttempt:
    """The ended attempt's PyTorchJob or TrainJob (its pods go with it)."""

    attempt: int


@dataclasses.dataclass(frozen=True, slots=True)
class RequestCheckpoint:
    attempt: int
    world_size: int
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class DeleteJob:
    """The finished job itself, past spec.ttlSecondsAfterFinished (its pods, Leases and
    Secret go with it by their owner references; its checkpoints stay). Sent only if the
    job is still the one read (uid and resourceVersion as preconditions)."""

    finished_at: float


@dataclasses.dataclass(frozen=True, slots=True)
class Emit:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Restarted:
    """For the metrics: an attempt ended and the job restarts."""

    reason: str
    cause: Cause


@dataclasses.dataclass(frozen=True, slots=True)
class Recovered:
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class CreateWorkload:
    """The job's Kueue Workload (queue.py): ``count`` ranks, admitted at ``min_count`` or
    more; ``priority``: its WorkloadPriorityClass and value."""

    count: int
    min_count: int
    priority: tuple[str, int] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PatchWorkload:
    """A write of the Workload's status (queue.status_patch makes it), conditional on the
    version observed (one changed since is left to the next tick, which sees it)."""

    workload: WorkloadView
    write: Write
    message: str = ""
    now: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class DeleteWorkload:
    """Its quota back at once (a suspended job asks Kueue again when it resumes)."""

    name: str


Action = (
    PatchStatus
    | CreateAttempt
    | CreateSpares
    | DeletePods
    | DeleteAttempt
    | DeleteJob
    | RequestCheckpoint
    | Emit
    | Restarted
    | Recovered
    | CreateWorkload
    | PatchWorkload
    | DeleteWorkload
)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...] = ()
    requeue_after: float | None = None
    note: str = ""  # why nothing is done, for the log

    def kinds(self) -> list[str]:
        return [type(a).__name__ for a in self.actions]

    def status(self) -> dict[str, Any]:
        """Every status field the plan writes, merged (for tests and logs)."""
        merged: dict[str, Any] = {}
        for a in self.actions:
            if isinstance(a, PatchStatus):
                merged.update(a.fields)
        return merged


# ---- rules ----


def backoff(spec: JobSpec, restarts: int) -> float:
    """Delay before the attempt after the n-th crash: doubles from backoffSeconds, capped."""
    return min(MAX_BACKOFF_S, spec.backoff_seconds * (2 ** min(restarts, 16)))


def phase_conditions(
    phase: Phase, reason: str, message: str, *, restarted: bool = False
) -> tuple[ConditionChange, ...]:
    """Entering ``phase``; a restart also sets ``Restarted``, why the last attempt ended,
    which outlives the restart itself."""
    entered = EnterPhase(phase, reason, message)
    if restarted:
        return (entered, SetCondition(Condition.RESTARTED, True, reason, message))
    return (entered,)


@dataclasses.dataclass(frozen=True, slots=True)
class Ending:
    reason: str
    message: str
    cause: Cause
    suspect: tuple[str, ...] = ()  # nodes not to trust until their kubelet is seen again
    size_cap: int | None = None
    stuck: tuple[str, ...] = ()  # pods that cannot stop when asked (a stopped trainer): forced


STARTUP_GRACE_S = 10.0
"""How long a Running rank that has not answered a heartbeat yet is given (or the timeout,
if longer): its sidecar may still be starting on a busy node (measured: 20 sidecars
starting on 2 cores took more than 3 s to answer), and every rank is unanswered to an
operator that has just started or been elected. A rank that has answered is judged
against the timeout from its last answer."""


def attempt_over(obs: Observation, current: Sequence[PodView]) -> Ending | None:
    """Why the running attempt is over; None while it is healthy (or only being drained)."""
    spec, state, now = obs.spec, obs.state, obs.now
    by_name = {n.name: n for n in obs.nodes}
    present = {p.node_rank for p in current}
    missing = sorted(set(range(state.world_size)) - present)
    started = state.attempt_started
    if missing and (started is None or now - started >= UNSEEN_GRACE_S):
        return Ending("PodDeleted", f"pod of node rank {missing[0]} is gone", Cause.NODE)
    seen = {p.name for p in obs.pods}
    for rank, name in enumerate(state.carried):  # existed before: absent is gone, not unseen
        if rank in missing and name not in seen:
            return Ending("PodDeleted", f"pod {name} (node rank {rank}) is gone", Cause.NODE)
    ranked = sorted(current, key=lambda p: p.node_rank)
    # the cluster's doing first: when a pod is deleted or its node lost, its peers crash
    # too (their collective breaks), and whichever rank is read first must not decide
    for p in ranked:
        node = by_name.get(p.node_name) if p.node_name else None
        if p.phase == "Succeeded":
            continue
        if p.terminating:
            return Ending("PodDeleted", f"pod {p.name} is being deleted", Cause.NODE)
        if p.phase == "Failed" and p.reason == "Evicted":
            return Ending("PodEvicted", f"pod {p.name} was evicted", Cause.NODE)
        if p.node_name is None:
            continue
        if node is None:
            msg = f"node {p.node_name} of pod {p.name} was deleted"
            return Ending("NodeDeleted", msg, Cause.NODE, (p.node_name,))
        if not node.ready:
            msg = f"node {p.node_name} of pod {p.name} is not ready"
            return Ending("NodeNotReady", msg, Cause.NODE, (p.node_name,))
    for p in ranked:
        if p.phase == "Failed":
            quiet = _silent_since_failure(obs, current, p)
            if quiet is not None:  # a peer went quiet: wait to learn whether it is lost
                quiet_for = obs.beats.get(quiet.node_rank) or 0.0
                if quiet_for <= spec.detection.heartbeat_timeout_seconds:
                    return None
                msg = (
                    f"rank {quiet.node_rank} (pod {quiet.name} on {quiet.node_name}) "
                    f"sent no heartbeat for {quiet_for:.0f}s, since before pod {p.name} failed"
                )
                return Ending("HeartbeatLost", msg, Cause.NODE, (quiet.node_name or "",))
            why = "; ".join(w for w in (p.reason, p.exit) if w)
            why = f" ({why})" if why else ""
            return Ending("PodFailed", f"pod {p.name} failed{why}", Cause.CRASH)
    if obs.controller_failure:
        reason = "TrainJobFailed" if spec.backend == Backend.TRAINJOB else "PyTorchJobFailed"
        return Ending(reason, obs.controller_failure, Cause.CRASH)
    timeout = spec.detection.heartbeat_timeout_seconds
    grace = max(STARTUP_GRACE_S, timeout)
    for p in ranked:
        silent, waited = obs.beats.get(p.node_rank), obs.unanswered.get(p.node_rank)
        if not p.beating:
            continue
        if silent is not None and silent > timeout:
            msg = (
                f"rank {p.node_rank} (pod {p.name} on {p.node_name}) sent no heartbeat for "
                f"{silent:.0f}s (failureDetection.heartbeatTimeoutSeconds={timeout:g})"
            )
            return Ending("HeartbeatLost", msg, Cause.NODE, (p.node_name or "",))
        if silent is None and waited is not None and waited > grace:
            msg = (
                f"rank {p.node_rank} (pod {p.name} on {p.node_name}) has answered no "
                f"heartbeat in the {waited:.0f}s since it was seen Running"
            )
            return Ending("HeartbeatLost", msg, Cause.NODE, (p.node_name or "",))
    for p in ranked:
        hung = obs.trainers.get(p.node_rank)
        if p.beating and hung is not None and hung > timeout:
            if any(q is not p and q.beating and _late(obs, q) for q in ranked):
                return None  # a peer's node may be lost: wait for its verdict
            msg = (
                f"the trainer of rank {p.node_rank} (pod {p.name}) has not run for {hung:.0f}s "
                f"while its sidecar answers (failureDetection.heartbeatTimeoutSeconds="
                f"{timeout:g}): stopped, or frozen holding the GIL"
            )
            return Ending("RankHung", msg, Cause.CRASH, stuck=(p.name,))
    waiting = [p for p in current if p.phase not in ("Running", "Succeeded")]
    started = state.attempt_started
    limit = spec.detection.scheduling_timeout_seconds
    if waiting and started is not None and now - started > limit:
        scheduled = sum(1 for p in current if p.node_name)
        first = min(waiting, key=lambda p: p.node_rank)
        why = f": {first.waiting}" if first.waiting else ""
        msg = (
            f"{len(waiting)} of {state.world_size} ranks not running after {limit:g}s "
            f"(failureDetection.schedulingTimeoutSeconds); pod {first.name}{why}"
        )
        cap = max(scheduled, spec.min_replicas)
        return Ending("Unschedulable", msg, Cause.NODE, size_cap=cap)
    return None


def _late(obs: Observation, rank: PodView) -> bool:
    """The rank's sidecar missed its last heartbeat: silent for over two periods.

    A trainer stalls when a peer's node dies (its collective waits or breaks), and the
    trainers' silence, counted from their last step, can pass the timeout before the lost
    rank's heartbeat does. So a hung trainer is judged only while every other rank answers
    on time: a late one is either lost (HeartbeatLost, the node's) or answers within the
    timeout, and then the hang is judged."""
    silent = obs.beats.get(rank.node_rank)
    return silent is not None and silent > 2 * obs.spec.detection.heartbeat_period_seconds


def _silent_since_failure(
    obs: Observation, current: Sequence[PodView], failed: PodView
) -> PodView | None:
    """A rank still Running that has not beaten since ``failed`` failed, if any.

    When a node dies, the ranks that survive it crash at once (their collective breaks)
    while the lost rank still reads Running. Such a failure is the node's, not the job's:
    it is judged a crash only once every rank still running has beaten since (or, once
    that rank has been silent past the heartbeat timeout, counted from its last beat, not
    from the crash: a lost node, HeartbeatLost)."""
    if failed.phase_age is None:
        return None
    for q in sorted(current, key=lambda q: q.node_rank):
        silent = obs.beats.get(q.node_rank)
        if q.beating and silent is not None:
            if silent >= failed.phase_age:
                return q
    return None


def recovery_budget(state: JobState, now: float) -> dict[str, Any]:
    """``status.lastRecovery``: the last unplanned restart's reason and its phases by the
    operator's clock (Unix seconds): the failure seen (the decision to end the attempt),
    the next attempt started (teardown and backoff done), every rank Running. What the
    ranks did after that (imports, rendezvous, restore, first step) their logs say
    (docs/benchmarks.md, "Recovery budget")."""
    seen = state.failure_seen_at if state.failure_seen_at is not None else now
    return {
        "reason": state.condition(Condition.RESTARTED).get("reason"),
        "failureSeenAt": seen,
        "attemptStarted": state.attempt_started,
        "runningAt": now,
        "seconds": round(max(0.0, now - seen), 3),
    }


def _older(obs: Observation) -> list[Action]:
    """Pods of attempts before the one read never outlive a restart (safe in any view),
    but for those it carries (kept for it, relabelled as it starts)."""
    state = obs.state
    names = tuple(
        p.name
        for p in obs.pods
        if p.attempt < state.attempt
        and not p.terminating
        and not p.spare
        and p.name not in state.carried
    )
    return [DeletePods(names)] if names else []


def survivors(obs: Observation, current: Sequence[PodView], ending: Ending) -> tuple[str, ...]:
    """The pods an unplanned end of the attempt keeps for the next one: running under the
    launcher (restartPolicy.inPlace) on a node still trusted, and not stuck. A planned end
    keeps none (its ranks stopped for good, their pods Succeeded)."""
    if ending.cause is Cause.PLANNED or not obs.spec.relaunches or spec_changed(obs):
        return ()
    suspect = {**obs.state.suspect, **dict.fromkeys(ending.suspect, obs.now)}
    live = _live_nodes(obs, suspect)
    return tuple(
        p.name
        for p in sorted(current, key=lambda p: p.node_rank)
        if p.relaunchable and p.node_name in live and p.name not in ending.stuck
    )


def spec_changed(obs: Observation) -> bool:
    """The spec was edited since the running attempt's pods were made from it (a SpecPending
    change): the next attempt makes every pod anew, so that all of them run it."""
    made = obs.state.attempt_generation
    return bool(obs.generation and made and obs.generation != made)


def suspect_patch(old: Mapping[str, float], new: Mapping[str, float]) -> dict[str, Any]:
    """``status.suspectNodes`` as a JSON merge patch: a node no longer suspect is written
    as null (merging ``{}`` would keep every old key)."""
    patch: dict[str, Any] = {name: None for name in old if name not in new}
    patch.update({name: mark for name, mark in new.items() if old.get(name) != mark})
    return patch


def _live_nodes(obs: Observation, suspect: Mapping[str, float]) -> set[str]:
    return {n.name for n in obs.nodes if n.ready and n.name not in suspect}


def _cleared_suspects(obs: Observation) -> dict[str, float]:
    """A suspect node is trusted again once its kubelet is seen alive after the mark."""
    alive = {n.name: n.alive_at for n in obs.nodes}
    return {
        name: mark
        for name, mark in obs.state.suspect.items()
        if name in alive and not ((alive[name] or 0.0) > mark)
    }


def target_size(obs: Observation, suspect: Mapping[str, float]) -> int:
    fits = [n for n in obs.fits if n not in suspect]
    cap = obs.state.size_cap if obs.state.size_cap is not None else obs.spec.max_replicas
    workload = obs.queue.workload if obs.queue is not None else None
    if workload is not None and workload.admitted_count is not None:
        cap = min(cap, workload.admitted_count)  # what Kueue admitted, no more
    return min(obs.spec.replicas, obs.spec.max_replicas, cap, len(fits))


def decide(obs: Observation) -> Plan:
    state = obs.state
    if state.phase in TERMINAL:
        finished = _finished(obs)
        deleted = any(isinstance(a, DeleteJob) for a in finished.actions)
        return finished if deleted else _observed(obs, finished)
    newer = [p for p in obs.pods if p.attempt > state.attempt]
    if newer:
        return Plan(
            requeue_after=1.0,
            note=f"stale view: pod {newer[0].name} is newer than attempt {state.attempt}",
        )
    return _observed(obs, _active(obs))


def observed(obs: Observation) -> PatchStatus | None:
    """What status must record of the job as read, whatever the plan: the generation acted
    on (and every condition re-stamped with it), the scale subresource's selector, and,
    once, when the operator took the job up (spec.activeDeadlineSeconds counts from it)."""
    state, update = obs.state, dict[str, Any]()
    changes: tuple[ConditionChange, ...] | None = None
    if obs.generation and obs.generation != state.observed_generation:
        update["observedGeneration"] = obs.generation
        pending = spec_pending(state, obs.generation)
        why = SetCondition(Condition.SPEC_PENDING, True, "AppliesAtNextAttempt", pending)
        changes = (why,) if pending else ()
    if obs.selector and obs.selector != state.selector:
        update["selector"] = obs.selector
    if state.start_time is None and state.phase not in TERMINAL and not obs.spec.suspend:
        update["startTime"] = rfc3339(obs.now)
    return PatchStatus(update, changes) if update else None


def spec_pending(state: JobState, generation: int) -> str:
    """Why the spec read (``generation``) is not what the running attempt runs, or "": a
    change made after the attempt started applies at the next attempt (the fields that
    cannot wait are immutable in the CRD)."""
    if not state.attempt or not state.attempt_generation or state.phase in TERMINAL:
        return ""
    if generation <= state.attempt_generation:
        return ""
    return (
        f"attempt {state.attempt} runs the spec of generation {state.attempt_generation}; "
        f"generation {generation} applies at the next attempt (a restart, a resize or a "
        "node's return): what the pods are made with is read when an attempt starts"
    )


def _observed(obs: Observation, plan: Plan) -> Plan:
    """``plan`` with ``observed(obs)`` written by its first action (merged into it where
    that is a status write: the plan's own fields and conditions win, being newer)."""
    update = observed(obs)
    if update is None:
        return plan
    first = plan.actions[0] if plan.actions else None
    if isinstance(first, PatchStatus):
        changes = update.conditions if first.conditions is None else first.conditions
        merged = PatchStatus({**update.fields, **first.fields}, changes)
        return dataclasses.replace(plan, actions=(merged, *plan.actions[1:]))
    return dataclasses.replace(plan, actions=(update, *plan.actions))


def _finished(obs: Observation) -> Plan:
    """A Succeeded or Failed job: deleted once its TTL is over; until then, a Failed job
    runs nothing (e.g. the pods created before one the API rejected)."""
    state, ttl = obs.state, obs.spec.ttl_seconds_after_finished
    finished = state.finished_at
    if ttl is not None and finished is not None and obs.now >= finished + ttl:
        return Plan((DeleteJob(finished),), note=f"spec.ttlSecondsAfterFinished={ttl} is over")
    running = tuple(
        p.name
        for p in obs.pods
        if not p.terminating
        and (
            p.spare  # a finished job needs no spare
            or (state.phase == "Failed" and p.attempt == state.attempt and p.phase not in TERMINAL)
        )
    )
    requeue = None if ttl is None or finished is None else max(0.0, finished + ttl - obs.now)
    done: list[Action] = []
    workload = obs.queue.workload if obs.queue is not None else None
    if workload is not None and not workload.finished:  # Kueue takes its quota back
        succeeded = state.phase == "Succeeded"
        ended = state.condition(Condition.SUCCEEDED if succeeded else Condition.FAILED)
        message = str(ended.get("message") or state.phase)
        write = Write.SUCCEEDED if succeeded else Write.FAILED
        done.append(PatchWorkload(workload, write, message, obs.now))
    running_pods = [DeletePods(running)] if running else []
    return Plan((*_older(obs), *running_pods, *done), requeue_after=requeue)


def deadline_passed(obs: Observation) -> str:
    """Why the job is past spec.activeDeadlineSeconds, or "" (counted from status.startTime,
    as a Kubernetes Job's; a job not yet started has not used any of it)."""
    deadline, started = obs.spec.active_deadline_seconds, obs.state.start_time
    if deadline is None or started is None or obs.now - started < deadline:
        return ""
    return (
        f"the job ran {obs.now - started:.0f}s since {rfc3339(started)}, past "
        f"spec.activeDeadlineSeconds={deadline}: its pods are removed, its checkpoints kept"
    )


def _active(obs: Observation) -> Plan:
    state = obs.state
    actions = _older(obs)
    current = [p for p in obs.pods if p.attempt == state.attempt and not p.spare]
    late = deadline_passed(obs)
    if late:
        return _fail(obs, current, "DeadlineExceeded", late, actions)
    if state.attempt == 0 or state.phase in ("Restarting", "Suspended"):
        return _between_attempts(obs, current, actions)
    if not state.pods_created and obs.refused:  # the attempt fails with the API's reason
        rejected = Ending("PodRejected", f"the API rejected a pod: {obs.refused}", Cause.CRASH)
        return _end_attempt(obs, current, rejected, actions)
    if not state.pods_created:  # the operator stopped while creating this attempt
        return Plan(
            (
                *actions,
                PatchStatus({}),  # sent with the resourceVersion read: fails if stale
                CreateAttempt(
                    state.attempt, state.world_size, tuple(sorted(state.suspect)), state.carried
                ),
                PatchStatus({"podsCreated": True}),
            )
        )
    ending = attempt_over(obs, current)
    if ending is not None:
        return _end_attempt(obs, current, ending, actions)
    if state.transition is not None:
        return _transitioning(obs, current, actions)
    if current and all(p.phase == "Succeeded" for p in current):
        return Plan(
            (
                *actions,
                PatchStatus(
                    {"phase": "Succeeded"},
                    phase_conditions(Phase.SUCCEEDED, "Completed", "every rank exited 0"),
                ),
                Emit("Normal", "Succeeded", "every rank exited 0"),
            )
        )
    return _running(obs, current, actions)


def _running(obs: Observation, current: Sequence[PodView], actions: list[Action]) -> Plan:
    spec, state, now = obs.spec, obs.state, obs.now
    update: dict[str, Any] = {}
    suspect = _cleared_suspects(obs)
    if suspect != dict(state.suspect):
        update["suspectNodes"] = suspect_patch(state.suspect, suspect)
    all_running = len(current) >= state.world_size and all(p.phase == "Running" for p in current)
    if all_running and state.healthy_since is None:
        update["healthySince"] = now
        if state.failure_seen_at is not None:
            actions.append(Recovered(max(0.0, now - state.failure_seen_at)))
            update["failureSeenAt"] = None
            update["lastRecovery"] = recovery_budget(state, now)
    if obs.last_checkpoint and dict(obs.last_checkpoint) != dict(state.last_checkpoint or {}):
        update["lastCheckpoint"] = dict(obs.last_checkpoint)
    if spec.suspend:
        return _begin_transition(obs, SUSPEND, "spec.suspend is true", actions, update)
    queued = obs.queue.workload if obs.queue is not None else None
    if obs.queue is not None and (queued is None or queued.evicted or not queued.admitted):
        return _begin_transition(obs, EVICTED, _evicted_why(obs.queue), actions, update)
    if queued is not None and queued.count != spec.replicas:
        msg = (
            f"spec.replicas is {spec.replicas}, Kueue admitted the job for {queued.count}:"
            " asking Kueue again"
        )
        return _begin_transition(obs, REQUEUED, msg, actions, update)
    if spec.replicas < state.world_size:
        reason, msg = "Resize", f"spec.replicas {spec.replicas} < world size {state.world_size}"
        return _begin_transition(obs, reason, msg, actions, update)
    ours = {p.node_name for p in current if p.node_name}
    drained = sorted(n.name for n in obs.nodes if n.cordoned and n.name in ours)
    if drained:
        return _begin_transition(obs, "NodeDrained", f"node {drained[0]} cordoned", actions, update)
    target = target_size(obs, suspect)
    requeue = None
    if target > state.world_size and spec.scale_up:
        since = state.capacity_since if state.capacity_since is not None else now
        if now - since >= spec.stabilization_seconds:
            msg = f"{target} nodes fit for {now - since:.0f}s: growing from {state.world_size}"
            return _begin_transition(obs, "ScaleUp", msg, actions, update)
        if state.capacity_since is None:
            update["capacitySince"] = since
        requeue = spec.stabilization_seconds - (now - since)
    elif state.capacity_since is not None:
        update["capacitySince"] = None
    spares = _spare_upkeep(obs, current, all_running, suspect)
    if queued is not None and all_running and not queued.pods_ready:
        spares.append(PatchWorkload(queued, Write.READY, now=now))  # else Kueue evicts it
    running_spares = sum(1 for p in obs.pods if p.spare and p.relaunchable)
    if running_spares != (obs.state.spares or 0):
        update["spares"] = running_spares
    if update or spares:
        actions.append(PatchStatus(update))  # first: a stale view acts on nothing
    return Plan((*actions, *spares), requeue_after=requeue)


def _spare_upkeep(
    obs: Observation, current: Sequence[PodView], all_running: bool, suspect: Mapping[str, float]
) -> list[Action]:
    """Keep spec.spares warm spares while the attempt runs: replace one that failed or
    whose node is gone, remove those past the count, make the missing ones once every rank
    runs (never competing with the attempt's own start). A spare that cannot be placed
    waits Pending, as a rank would."""
    spec, state = obs.spec, obs.state
    live = _live_nodes(obs, suspect)
    spares = sorted((p for p in obs.pods if p.spare and not p.terminating), key=lambda p: p.name)
    dead = [
        p
        for p in spares
        if p.phase in TERMINAL
        or (p.node_name and p.node_name not in live)
        # kept off a node trusted again, and still waiting: made anew, free to go there
        or (not p.node_name and set(p.avoid) - set(suspect))
    ]
    alive = [p for p in spares if p not in dead]
    wanted = spec.spares if spec.relaunches else 0
    extra = alive[wanted:]
    actions: list[Action] = []
    forced = tuple(p.name for p in dead if p.node_name and p.node_name not in live)
    if forced:
        actions.append(DeletePods(forced, force=True))
    graceful = tuple(p.name for p in [*dead, *extra] if p.name not in forced)
    if graceful:
        actions.append(DeletePods(graceful))
    missing = wanted - len(alive)
    if missing > 0 and all_running:
        taken = {p.name for p in obs.pods}
        names: list[str] = []
        index = 0
        while len(names) < missing:
            name = spare_name(obs.job, state.attempt, index)
            if name not in taken:
                names.append(name)
            index += 1
        peers = tuple(p.name for p in sorted(current, key=lambda p: p.node_rank))
        actions.append(CreateSpares(tuple(names), peers, tuple(sorted(suspect))))
    return actions


def _evicted_why(queue: Queue) -> str:
    """Why a running queued job stops: Kueue evicted its Workload, or it is gone."""
    workload = queue.workload
    if workload is None:
        return f"its Kueue Workload is gone (LocalQueue {queue.name})"
    if workload.evicted:
        return f"Kueue evicted it ({workload.evicted})"
    return f"Kueue no longer admits it (LocalQueue {queue.name})"


def _begin_transition(
    obs: Observation, reason: str, message: str, actions: list[Action], update: dict[str, Any]
) -> Plan:
    """Ask every rank to checkpoint at its next step boundary and stop (zero lost steps);
    the attempt ends when its pods have finished or the wait is over."""
    state, now = obs.state, obs.now
    if obs.spec.transition_timeout_seconds <= 0:
        return _end_attempt(obs, [], Ending(reason, message, Cause.PLANNED), actions)
    request = f"{state.attempt}-{reason}-{int(now)}"
    then = "its pods go" if reason in PAUSES else "restart"
    update["transition"] = {
        "reason": reason,
        "message": message,
        "requestedAt": now,
        "requestId": request,
    }
    return Plan(
        (
            *actions,
            PatchStatus(update),
            RequestCheckpoint(state.attempt, state.world_size, request),
            Emit("Normal", "CheckpointRequested", f"{message}: checkpointing before {then}"),
        ),
        requeue_after=1.0,
    )


def _transitioning(obs: Observation, current: Sequence[PodView], actions: list[Action]) -> Plan:
    state, now = obs.state, obs.now
    assert state.transition is not None
    t = state.transition
    update: dict[str, Any] = {}
    if obs.last_checkpoint and dict(obs.last_checkpoint) != dict(state.last_checkpoint or {}):
        update["lastCheckpoint"] = dict(obs.last_checkpoint)
    waited = now - t.requested_at
    if current and all(p.phase == "Succeeded" for p in current):
        ending = Ending(t.reason, f"{t.message}; checkpointed and stopped", Cause.PLANNED)
        return _end_attempt(obs, current, ending, actions, update)
    if waited > obs.spec.transition_timeout_seconds:
        msg = (
            f"{t.message}; no stop {waited:.0f}s after the checkpoint request "
            "(transitions.checkpointTimeoutSeconds): steps since the last checkpoint are lost"
        )
        return _end_attempt(obs, current, Ending(t.reason, msg, Cause.PLANNED), actions, update)
    if update:
        actions.append(PatchStatus(update))
    return Plan(tuple(actions), requeue_after=1.0)


def _end_attempt(
    obs: Observation,
    current: Sequence[PodView],
    ending: Ending,
    actions: list[Action],
    update: dict[str, Any] | None = None,
) -> Plan:
    spec, state, now = obs.spec, obs.state, obs.now
    update = dict(update or {})
    restarts, node_restarts = state.restarts, state.node_restarts
    not_before = None
    if ending.cause is Cause.CRASH:
        healthy = state.healthy_since is not None and now - state.healthy_since
        if healthy and healthy >= spec.reset_after_seconds:
            restarts = 0  # a long healthy run forgives earlier crashes
        if restarts >= spec.max_restarts:
            message = (
                f"{ending.message}; giving up after {restarts} restarts "
                f"(spec.restartPolicy.maxRestarts={spec.max_restarts})"
            )
            update["restarts"] = restarts
            return _fail(obs, current, "MaxRestartsExceeded", message, actions, update)
        not_before = now + backoff(spec, restarts)
        restarts += 1
    elif ending.cause is Cause.NODE:
        node_restarts += 1
    suspect = dict(state.suspect)
    for node in ending.suspect:
        suspect.setdefault(node, now)
    kept = survivors(obs, current, ending)
    failure_seen = state.failure_seen_at
    if failure_seen is None and ending.cause is not Cause.PLANNED:
        failure_seen = now
    update.update(
        {
            "phase": "Restarting",
            "restarts": restarts,
            "nodeRestarts": node_restarts,
            "notBefore": not_before,
            "failureSeenAt": failure_seen,
            "podsCreated": False,
            "tornDown": False,
            "teardownSince": now,
            "healthySince": None,
            "transition": None,
            "suspectNodes": suspect_patch(state.suspect, suspect),
            "sizeCap": ending.size_cap,
            "survivors": list(kept) or None,
        }
    )
    suspending = ending.reason in PAUSES  # no restart: nothing starts until resumed
    restarting = phase_conditions(
        Phase.RESTARTING, ending.reason, ending.message, restarted=not suspending
    )
    kind = "Normal" if ending.cause is Cause.PLANNED else "Warning"
    said = {SUSPEND: "suspending", EVICTED: "stopping", REQUEUED: "stopping"}.get(
        ending.reason, "restarting"
    )
    return Plan(
        (
            *actions,
            PatchStatus(update, restarting),
            Emit(kind, ending.reason, f"{said}: {ending.message}"),
            *([] if suspending else [Restarted(ending.reason, ending.cause)]),
            *_teardown(obs, current, suspect, stuck=ending.stuck, keep=kept),
            PatchStatus({"tornDown": True}),
        ),
        requeue_after=1.0,
    )


def _fail(
    obs: Observation,
    current: Sequence[PodView],
    reason: str,
    message: str,
    actions: list[Action],
    update: Mapping[str, Any] | None = None,
) -> Plan:
    """The job gives up: Failed (final), the attempt's pods removed, its checkpoints kept."""
    failed = PatchStatus(
        {**(update or {}), "phase": "Failed"}, phase_conditions(Phase.FAILED, reason, message)
    )
    teardown = _teardown(obs, current) if obs.state.attempt else []
    return Plan((*actions, failed, *teardown, Emit("Warning", reason, message)))


def _teardown(
    obs: Observation,
    current: Sequence[PodView],
    suspect: Mapping[str, float] | None = None,
    *,
    stuck: Sequence[str] = (),
    keep: Sequence[str] = (),
) -> list[Action]:
    """Delete the attempt: gracefully where a kubelet can stop the pod, by force where none
    can (its node is gone, NotReady or suspect) or where the pod cannot stop when asked
    (``stuck``: a stopped trainer ignores SIGTERM until the grace period ends); a
    force-deleted straggler cannot harm the next attempt (a fresh rendezvous port, and
    saves fenced by attempt). Pods in ``keep`` stay for the next attempt."""
    live = _live_nodes(obs, obs.state.suspect if suspect is None else suspect)
    current = [p for p in current if p.name not in keep]

    def forced(p: PodView) -> bool:
        return p.node_name is not None and (p.node_name not in live or p.name in stuck)

    graceful = tuple(p.name for p in current if not p.terminating and not forced(p))
    forced_names = tuple(p.name for p in current if forced(p))
    actions: list[Action] = [DeleteAttempt(obs.state.attempt)]
    if graceful:
        actions.append(DeletePods(graceful))
    if forced_names:
        actions.append(DeletePods(forced_names, force=True))
    return actions


def _between_attempts(obs: Observation, current: Sequence[PodView], actions: list[Action]) -> Plan:
    spec, state, now = obs.spec, obs.state, obs.now
    update: dict[str, Any] = {}
    suspect = _cleared_suspects(obs)
    if suspect != dict(state.suspect):
        update["suspectNodes"] = suspect_patch(state.suspect, suspect)
    live = _live_nodes(obs, suspect)
    fresh = spec_changed(obs)  # edited since the survivors were made: none is kept
    kept = [
        p
        for p in current
        if p.name in state.survivors
        and p.relaunchable
        and p.node_name in live
        and not fresh
        and not spec.suspend
    ]
    if state.attempt and not state.torn_down:  # the operator stopped mid-teardown
        keep = [p.name for p in kept]
        actions += [PatchStatus(update), *_teardown(obs, current, suspect, keep=keep)]
        actions.append(PatchStatus({"tornDown": True}))
        return Plan(tuple(actions), requeue_after=1.0)
    if update:
        actions.append(PatchStatus(update))
    current = [p for p in current if p not in kept]  # the rest go, whatever they were
    undeleted = tuple(p.name for p in current if not p.terminating)
    if undeleted:  # e.g. created just before a rejected one
        actions.append(DeletePods(undeleted))
    lingering = list(current)
    if lingering:
        since = state.teardown_since if state.teardown_since is not None else now
        deadline = since + spec.detection.teardown_deadline_seconds
        force = tuple(
            p.name
            for p in lingering
            if p.node_name is not None and (p.node_name not in live or now >= deadline)
        )
        if force:
            actions.append(DeletePods(force, force=True))
        return Plan(
            tuple(actions),
            requeue_after=1.0,
            note=f"{len(lingering)} pods of attempt {state.attempt} still terminating "
            f"(first: {lingering[0].name})",
        )
    if spec.suspend:
        return _suspended(obs, actions)
    if state.not_before is not None and now < state.not_before:
        return Plan(tuple(actions), requeue_after=state.not_before - now, note="backoff")
    if obs.queue is not None:
        waiting = _not_admitted(obs, obs.queue, actions)
        if waiting is not None:
            return waiting
    target = target_size(obs, suspect)
    if target < spec.min_replicas:
        fits = len([n for n in obs.fits if n not in suspect])
        message = f"{fits} nodes can run a rank; the job needs at least {spec.min_replicas}"
        if obs.rejected:
            message += f" ({obs.rejected})"
        if not _says_queued(state, "InsufficientNodes", message):
            actions.append(_queued_write(state, "InsufficientNodes", message))
            actions.append(Emit("Warning", "InsufficientNodes", message))
        return Plan(tuple(actions), requeue_after=5.0, note="insufficient nodes")
    attempt = state.attempt + 1
    spares = sorted(
        (p for p in obs.pods if p.spare and p.relaunchable and p.node_name in live and not fresh),
        key=lambda p: p.name,
    )
    unkept: list[Action] = []  # sent after the start's status write (a stale view: none)
    if fresh:  # spares made from the spec before the edit go too; new ones follow
        stale = tuple(p.name for p in obs.pods if p.spare and not p.terminating)
        if stale:
            unkept.append(DeletePods(stale))
    warm = [*sorted(kept, key=lambda p: p.node_rank), *spares]  # spares take the lost ranks
    carried = tuple(p.name for p in warm[:target])
    dropped = tuple(p.name for p in kept if p.name not in carried)
    if dropped:  # the job shrank below its survivors (spec.replicas, or fewer nodes fit)
        unkept.append(DeletePods(dropped))
    message = f"attempt {attempt} at world size {target}"
    taken = [p for p in spares if p.name in carried]
    if carried:
        message += f", {len(carried)} pods kept (their workers restart in place"
        message += f"; {len(taken)} of them spares)" if taken else ")"
    start: dict[str, Any] = {
        **update,
        "phase": "Running",
        "attempt": attempt,
        "worldSize": target,
        "podsCreated": False,
        "notBefore": None,
        "capacitySince": None,
        "attemptStarted": now,
        "healthySince": None,
        "teardownSince": None,
        "sizeCap": None,
        "transition": None,
        "survivors": None,
        "carried": list(carried) or None,
    }
    # the new attempt runs the spec read: a SpecPending condition turns False
    applied = f"attempt {attempt} runs generation {obs.generation}"
    started = (
        *phase_conditions(Phase.RUNNING, "Started", message),
        SetCondition(Condition.SPEC_PENDING, False, "Applied", applied, only_if_true=True),
    )
    if obs.generation:
        start["attemptGeneration"] = obs.generation
    if state.storage is None:
        start["storage"] = {"uri": obs.uri}
    node_labels = obs.queue.node_labels if obs.queue else {}
    tolerations = obs.queue.tolerations if obs.queue else ()
    return Plan(
        (
            *[a for a in actions if not isinstance(a, PatchStatus)],
            PatchStatus(start, started),
            *unkept,
            Emit("Normal", "AttemptStarted", message),
            CreateAttempt(
                attempt, target, tuple(sorted(suspect)), carried, node_labels, tuple(tolerations)
            ),  # fmt: skip
            PatchStatus({"podsCreated": True}),
        )
    )


def _not_admitted(obs: Observation, queue: Queue, actions: list[Action]) -> Plan | None:
    """A queued job between attempts, until Kueue admits it (None: admitted, start). Its
    Workload is made once, and again after spec.replicas changed (the old one deleted:
    its quota back); an evicted one's quota is given back once no pod of the job is left
    (the caller waited for that), and Kueue requeues it."""
    state, workload = obs.state, queue.workload
    if not queue.installed:
        reason = "KueueNotServed"
        message = (
            f"the job names LocalQueue {queue.name} (label {kueue.QUEUE_LABEL}) but this "
            f"cluster serves no {kueue.GROUP}/{kueue.VERSION} Workloads: install Kueue "
            "(v0.19 or later) or remove the label"
        )
    elif queue.priority_missing:
        reason = "PriorityClassNotFound"
        message = (
            f"no WorkloadPriorityClass {queue.priority_missing} (label "
            f"{kueue.PRIORITY_LABEL}): create it or remove the label"
        )
    elif workload is None:
        reason, message = "WaitingForAdmission", f"waiting for Kueue (LocalQueue {queue.name})"
        actions.append(PatchStatus({}))  # first: a stale view makes nothing
        actions.append(CreateWorkload(obs.spec.replicas, obs.spec.min_replicas, queue.priority))
    elif workload.evicted and workload.quota_reserved:
        reason, cause = workload.evicted.split(": ", 1)
        message = f"Kueue evicted the job: {cause}; its quota is given back"
        actions.append(PatchStatus({}))
        actions.append(PatchWorkload(workload, Write.RELEASE, cause, obs.now))
    elif workload.count != obs.spec.replicas:  # resized: its admission goes with it
        reason = "WaitingForAdmission"
        message = (
            f"waiting for Kueue (LocalQueue {queue.name}) to admit the job at its new size,"
            f" spec.replicas {obs.spec.replicas}"
        )
        actions.append(PatchStatus({}))  # first: a stale view deletes nothing
        actions.append(DeleteWorkload(workload.name))
    elif not workload.admitted:
        reason, message = "WaitingForAdmission", f"waiting for Kueue (LocalQueue {queue.name})"
    else:
        return None
    if not _says_queued(state, reason, message):
        others = [a for a in actions if not isinstance(a, PatchStatus)]
        actions = [_queued_write(state, reason, message, Plan(tuple(actions)).status()), *others]
        actions.append(Emit("Normal", reason, message))
    return Plan(tuple(actions), requeue_after=5.0, note=f"queued: {reason}")


def _says_queued(state: JobState, reason: str, message: str) -> bool:
    """The job's Queued condition says this already (nothing to write)."""
    queued = state.condition(Condition.QUEUED)
    return (queued.get("status"), queued.get("reason"), queued.get("message")) == (
        "True",
        reason,
        message,
    )


def _queued_write(
    state: JobState, reason: str, message: str, fields: Mapping[str, Any] | None = None
) -> PatchStatus:
    """Queued True for ``reason`` (phase Pending before a first attempt), with ``fields``."""
    phase = state.phase if state.attempt else "Pending"
    why = SetCondition(Condition.QUEUED, True, reason, message)
    return PatchStatus({**(fields or {}), "phase": phase}, (why,))


def _suspended(obs: Observation, actions: list[Action]) -> Plan:
    """spec.suspend with no attempt running: no pod (its spares go too), phase Suspended,
    and status.startTime cleared, so that spec.activeDeadlineSeconds counts again from the
    resume (as a Kubernetes Job's does)."""
    state = obs.state
    spares = tuple(p.name for p in obs.pods if p.spare and not p.terminating)
    deletes: list[Action] = [DeletePods(spares)] if spares else []
    if obs.queue is not None and obs.queue.workload is not None:  # its quota back
        deletes.append(DeleteWorkload(obs.queue.workload.name))
    if state.phase == Phase.SUSPENDED:
        if deletes and not any(isinstance(a, PatchStatus) for a in actions):
            actions.append(PatchStatus({}))  # first: a stale view deletes nothing
        return Plan((*actions, *deletes), note="suspended (spec.suspend)")
    ended = state.condition(Condition.RESTARTING)
    if state.attempt and ended.get("reason") == SUSPEND:  # how the suspend's attempt ended
        message = f"attempt {state.attempt}: {ended.get('message')}"
    elif state.attempt:
        message = f"attempt {state.attempt} ended ({ended.get('reason')}); spec.suspend is true"
    else:
        message = "spec.suspend is true: no attempt starts until it is false"
    update = {"phase": "Suspended", "startTime": None, "notBefore": None, "spares": 0}
    entered = (EnterPhase(Phase.SUSPENDED, SUSPEND, message),)
    return Plan(
        (
            *[a for a in actions if not isinstance(a, PatchStatus)],
            PatchStatus({**Plan(tuple(actions)).status(), **update}, entered),
            *deletes,
            Emit("Normal", SUSPEND, message),
        ),
        note="suspended (spec.suspend)",
    )


def invalid_spec(state: JobState, message: str, generation: int = 0) -> Plan:
    """A spec that cannot work fails the job, once, with a condition naming the field (the
    CRD's rules refuse such a spec at apply: this is for a job stored before them)."""
    if state.phase == "Failed":
        if generation and generation != state.observed_generation:
            return Plan((PatchStatus({"observedGeneration": generation}, ()),))
        return Plan(note="failed: invalid spec")
    failed = PatchStatus(
        {"phase": "Failed", **({"observedGeneration": generation} if generation else {})},
        (EnterPhase(Phase.FAILED, "InvalidSpec", message),),
    )
    return Plan((failed, Emit("Warning", "InvalidSpec", message)))


def job_state(status: Mapping[str, Any]) -> JobState:
    """The decisions' view of .status (absent fields take their defaults)."""
    t = status.get("transition")
    storage = status.get("storage") or {}
    return JobState(
        phase=status.get("phase") or "Pending",
        attempt=int(status.get("attempt") or 0),
        world_size=int(status.get("worldSize") or 0),
        restarts=int(status.get("restarts") or 0),
        node_restarts=int(status.get("nodeRestarts") or 0),
        pods_created=bool(status.get("podsCreated")),
        torn_down=status.get("tornDown") is not False,
        not_before=status.get("notBefore"),
        capacity_since=status.get("capacitySince"),
        attempt_started=status.get("attemptStarted"),
        healthy_since=status.get("healthySince"),
        teardown_since=status.get("teardownSince"),
        failure_seen_at=status.get("failureSeenAt"),
        size_cap=status.get("sizeCap"),
        suspect=dict(status.get("suspectNodes") or {}),
        transition=Transition(
            t["reason"], t.get("message", ""), float(t["requestedAt"]), t["requestId"]
        )
        if t
        else None,
        last_checkpoint=status.get("lastCheckpoint"),
        storage=storage.get("uri"),
        conditions=tuple(status.get("conditions") or ()),
        observed_generation=int(status.get("observedGeneration") or 0),
        attempt_generation=int(status.get("attemptGeneration") or 0),
        selector=str(status.get("selector") or ""),
        start_time=parse_time(status["startTime"]) if status.get("startTime") else None,
        survivors=tuple(str(n) for n in status.get("survivors") or ()),
        carried=tuple(str(n) for n in status.get("carried") or ()),
        spares=int(status.get("spares") or 0),
    )
