"""A job's ``status.conditions``, with metav1.Condition semantics: pure.

decisions.py says what each status write changes (``EnterPhase``, ``SetCondition``);
``written`` makes those changes into the exact list each write sends, from the conditions
read, the clock and the generation read.

One condition per type (ctj_contract.Condition), each True or False with a reason, a
message, the time its status last changed and the generation it was set from, so that
``kubectl wait --for=condition=Succeeded``, GitOps health checks and dashboards that read
standard conditions can follow a job. The rules:

- ``lastTransitionTime`` changes only when that condition's status changes; a condition
  whose status holds keeps it, even when its reason or message change.
- Entering a phase sets the phase's condition True and the other phases' False (a
  condition already False keeps its reason: it says why it last turned False).
- Every write stamps every condition with the generation read: the operator has judged
  them all against that spec. kubectl wait waits while a condition's observedGeneration
  is behind metadata.generation, so an edit must not leave one behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ctj_contract import Condition, Phase, rfc3339

from .decisions import Action, ConditionChange, EnterPhase, PatchStatus, Plan

PHASE_CONDITION = {
    Phase.PENDING: Condition.QUEUED,
    Phase.RUNNING: Condition.RUNNING,
    Phase.RESTARTING: Condition.RESTARTING,
    Phase.SUCCEEDED: Condition.SUCCEEDED,
    Phase.FAILED: Condition.FAILED,
    Phase.SUSPENDED: Condition.SUSPENDED,
}
ONLY_ONCE_TRUE = (Condition.SUSPENDED,)
"""Phases' conditions absent until first True (most jobs are never suspended)."""
ORDER = tuple(Condition)
"""How the list is kept: the phases' conditions first, then Restarted."""
LEGACY = ("Waiting",)
"""Types older operators wrote and this one replaced (Waiting became Queued)."""


def find(conditions: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def stamped(conditions: Sequence[Mapping[str, Any]], generation: int) -> list[dict[str, Any]]:
    """The conditions as this operator keeps them: legacy types dropped, in ``ORDER``,
    each carrying ``generation`` (where the job has one: 0 is "not read")."""
    kept = [dict(c) for c in conditions if c.get("type") not in LEGACY]
    rank = {kind.value: i for i, kind in enumerate(ORDER)}
    kept.sort(key=lambda c: rank.get(str(c.get("type")), len(rank)))
    if generation:
        for c in kept:
            c["observedGeneration"] = generation
    return kept


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    *,
    now: float,
    generation: int,
) -> list[dict[str, Any]]:
    """``conditions`` with ``kind`` set; its lastTransitionTime is ``now`` only if its
    status changed (or it is new)."""
    value = "True" if status else "False"
    old = find(conditions, kind)
    since = old.get("lastTransitionTime") if old and old.get("status") == value else None
    new = {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or rfc3339(now),
    }
    rest = [c for c in conditions if c.get("type") != kind]
    return stamped([*rest, new], generation)


def enter_phase(
    conditions: Sequence[Mapping[str, Any]],
    phase: Phase,
    reason: str,
    message: str,
    *,
    now: float,
    generation: int,
) -> list[dict[str, Any]]:
    """The conditions on entering ``phase``: its own True with ``reason``; the other
    phases' False (with ``reason`` where they turn False now, unchanged where they were).
    Suspended is written only for a job that has been suspended (as a Kubernetes Job's)."""
    out: Sequence[Mapping[str, Any]] = conditions
    for other, kind in PHASE_CONDITION.items():
        if other is phase:
            continue
        old = find(out, kind)
        if old is None and kind in ONLY_ONCE_TRUE:
            continue
        if old is None or old.get("status") != "False":
            out = set_condition(out, kind, False, reason, message, now=now, generation=generation)
    own = PHASE_CONDITION[phase]
    return set_condition(out, own, True, reason, message, now=now, generation=generation)


def written(
    plan: Plan, conditions: Sequence[Mapping[str, Any]], *, now: float, generation: int
) -> Plan:
    """``plan`` with each status write's condition changes made into the list it sends,
    each write's starting from the one before it (the first from ``conditions``)."""
    current: Sequence[Mapping[str, Any]] = conditions
    actions: list[Action] = []
    for action in plan.actions:
        if isinstance(action, PatchStatus) and action.conditions is not None:
            for change in action.conditions:
                current = _changed(current, change, now=now, generation=generation)
            kept = stamped(current, generation)
            fields = {**action.fields, "conditions": kept} if kept else action.fields
            action = PatchStatus(fields)
        actions.append(action)
    return dataclasses.replace(plan, actions=tuple(actions))


def _changed(
    conditions: Sequence[Mapping[str, Any]], change: ConditionChange, *, now: float, generation: int
) -> list[dict[str, Any]]:
    if isinstance(change, EnterPhase):
        return enter_phase(
            conditions, change.phase, change.reason, change.message, now=now, generation=generation
        )
    found = find(conditions, change.kind)
    if change.only_if_true and (found is None or found.get("status") != "True"):
        return [dict(c) for c in conditions]
    return set_condition(
        conditions,
        change.kind,
        change.status,
        change.reason,
        change.message,
        now=now,
        generation=generation,
    )
