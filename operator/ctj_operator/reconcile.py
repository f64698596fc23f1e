"""One reconcile of one job: observe -> decide -> render -> apply, in that order.

The job's spec is parsed (spec.py), its view of the cluster read from the watches'
indexes (observe.py), the decisions made (decisions.py: a Plan, pure), each action
rendered as the API calls that carry it out (render.py, pure) and the calls sent
(apply.py). At steady state this sends no request at all.

The first status write of a plan carries the resourceVersion the plan was made from: if
the job changed meanwhile (this process's view lagged), the write is a 409 and nothing of
the plan is applied; the next tick decides again from the newer view. Every call is
idempotent and status is written before the objects it describes are created, so an
operator killed at any moment converges on restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ctj_contract import Phase
from ctj_contract.tokens import job_token

from .apply import Outcome, apply
from .decisions import (
    CreateAttempt,
    JobState,
    Observation,
    Plan,
    decide,
    invalid_spec,
    job_state,
    pod_rejected,
)
from .heartbeats import JobAsk
from .observe import Indexes, observe
from .render import Target, render_plan
from .runtime import Operator
from .spec import JobSpec, SpecError, job_checkpoint_uri

log = logging.getLogger("ctj.operator")


def reconcile(op: Operator, body: Mapping[str, Any], indexes: Indexes) -> None:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    rv = str(meta.get("resourceVersion"))
    generation = int(meta.get("generation") or 0)
    if not op.leads() or op.stale(uid, rv):
        return
    spec: JobSpec | None = None
    try:
        spec = JobSpec.parse(
            dict(body.get("spec") or {}),
            sidecar_image=op.config.sidecar_image,
            node_cache=op.config.node_cache,
        )
    except SpecError as exc:
        invalid = str(exc)
    state = job_state(dict(body.get("status") or {}))
    obs: Observation | None = None
    if spec is None:
        plan = invalid_spec(state, invalid, time.time(), generation)
        target = Target(body=body, spec=None)
    else:
        op.metrics.job_seen(
            namespace, name, state.phase, state.world_size, state.attempt, state.last_checkpoint
        )
        uri = state.storage or job_checkpoint_uri(spec, namespace, name, uid)
        obs = observe(
            spec,
            state,
            key=(namespace, name),
            uri=uri,
            indexes=indexes,
            marks=op.marks,
            now=time.time(),
            read_pytorchjob=op.api.read_pytorchjob,
            generation=generation,
            last_checkpoint=op.channel.last_checkpoint((namespace, name)) if op.channel else None,
        )
        plan = decide(obs)
        _log_fits(op, uid, namespace, name, obs)
        token = job_token(op.config.job_key, namespace, name, uid)
        target = Target(
            body=body,
            spec=spec,
            uri=uri,
            cache_token=token,
            network_policy=op.config.network_policy,
        )
        if op.channel is not None:
            op.channel.want((namespace, name), _heartbeat_ask(uid, spec, state))
    _log_plan(namespace, name, state.attempt, plan)
    outcome = _send(op, plan, target, rv)
    if outcome.refused and obs is not None:  # the attempt fails with the API's reason
        log.warning(
            "%s/%s: the attempt's objects were rejected: %s", namespace, name, outcome.refused
        )
        created = next(a for a in plan.actions if isinstance(a, CreateAttempt))
        refused = pod_rejected(obs, created.attempt, created.world_size, outcome.refused)
        outcome = _send(op, refused, target, outcome.resource_version)
    if outcome.namespace_terminating:
        log.info("%s/%s: namespace terminating, nothing started", namespace, name)
    if outcome.stale:
        log.info("%s/%s: the job changed since it was read; deciding again", namespace, name)


def _heartbeat_ask(uid: str, spec: JobSpec, state: JobState) -> JobAsk:
    """What the heartbeat channel says to the job's ranks, from its status alone (an
    operator that restarts says the same): the attempt, whether it is over, and the
    checkpoint request of a planned transition."""
    over = state.phase in (Phase.RESTARTING, Phase.SUCCEEDED, Phase.FAILED)
    return JobAsk(
        uid=uid,
        attempt=state.attempt,
        ended=over,
        request=state.transition.request_id if state.transition else None,
        period_s=spec.detection.heartbeat_period_seconds,
    )


def _send(op: Operator, plan: Plan, target: Target, rv: str) -> Outcome:
    """Render and apply ``plan``; remember the job's version after our status writes."""
    rendered = render_plan(plan, target)
    outcome = apply(
        rendered,
        op.api,
        resource_version=rv,
        on_applied=lambda action: op.metrics.record(target.namespace, target.name, action),
    )
    if outcome.resource_version != rv:
        op.written[target.body["metadata"]["uid"]] = outcome.resource_version
    return outcome


def _log_fits(op: Operator, uid: str, namespace: str, name: str, obs: Observation) -> None:
    """Where a rank fits, logged when the count changes."""
    if op.fits_logged.get(uid) != len(obs.fits):
        op.fits_logged[uid] = len(obs.fits)
        rejected = f" ({obs.rejected})" if obs.rejected else ""
        log.info("%s/%s: %d nodes fit a rank%s", namespace, name, len(obs.fits), rejected)


def _log_plan(namespace: str, name: str, attempt: int, plan: Plan) -> None:
    """A plan that does more than write status is logged; a quiet one's note at debug."""
    kinds = [type(a).__name__ for a in plan.actions]
    if kinds and kinds != ["PatchStatus"] or "Emit" in kinds:
        log.info("%s/%s attempt %d: %s", namespace, name, attempt, ", ".join(kinds))
    elif plan.note:
        log.debug("%s/%s: %s", namespace, name, plan.note)
