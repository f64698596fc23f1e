"""One reconcile of one job: observe -> decide -> render -> apply, in that order.

The job's spec is parsed (spec.py), its view of the cluster read from the watches'
indexes (observe.py), the decisions made (decisions.py: a Plan, pure), each action
rendered as the API calls that carry it out (render.py, pure) and the calls sent
(apply.py). At steady state this sends no request at all.

An object the API refuses as the attempt is created (422, quota, admission) is noted
(``Operator.refused``) and observed by the next reconcile, a second later, which ends the
attempt with the API's reason: one pass never sends twice.

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

from ctj_contract.tokens import job_token

from . import conditions
from .apply import apply
from .decisions import CreateAttempt, Emit, Observation, decide, invalid_spec, job_state
from .heartbeats import JobAsk
from .observe import Indexes, observe
from .render import Target, render_plan
from .runtime import Operator
from .spec import JobSpec, SpecError, job_checkpoint_uri

log = logging.getLogger("ctj.operator")


def reconcile(op: Operator, body: Mapping[str, Any], indexes: Indexes) -> None:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    key = (namespace, name)
    rv = str(meta.get("resourceVersion"))
    generation = int(meta.get("generation") or 0)
    if not op.leads() or op.stale(uid, rv):
        return
    now = time.time()
    spec: JobSpec | None = None
    try:
        spec = JobSpec.parse(
            dict(body.get("spec") or {}),
            sidecar_image=op.config.sidecar_image,
            node_cache=op.config.node_cache,
            labels=meta.get("labels") or {},
        )
    except SpecError as exc:
        invalid = str(exc)
    state = job_state(dict(body.get("status") or {}))
    # observe
    obs: Observation | None = None
    uri = ""
    if spec is not None:
        op.metrics.job_seen(
            namespace, name, state.phase, state.world_size, state.attempt, state.last_checkpoint
        )
        last_checkpoint = None
        if op.channel is not None:  # what the ranks are told, from the status read
            op.channel.want(key, JobAsk.for_job(uid, name, spec, state))
            last_checkpoint = op.channel.last_checkpoint(key)
        uri = state.storage or job_checkpoint_uri(spec, namespace, name, uid)
        refused = op.refused.get(uid)
        obs = observe(
            spec,
            state,
            key=key,
            uri=uri,
            indexes=indexes,
            marks=op.marks,
            now=now,
            read_attempt=op.api.read_attempt,
            generation=generation,
            last_checkpoint=last_checkpoint,
            refused=refused[1] if refused and refused[0] == state.attempt else "",
        )
        if op.fits_logged.get(uid) != len(obs.fits):  # where a rank fits, when it changes
            op.fits_logged[uid] = len(obs.fits)
            why = f" ({obs.rejected})" if obs.rejected else ""
            log.info("%s/%s: %d nodes fit a rank%s", namespace, name, len(obs.fits), why)
    # decide
    plan = decide(obs) if obs is not None else invalid_spec(state, invalid, generation)
    kinds = plan.kinds()
    # what the ranks are told once the plan's status writes are in (an attempt that ended
    # or started: the survivors' assignments)
    writes = plan.status()  # at steady state none: the status read is parsed once a tick
    after = job_state({**dict(body.get("status") or {}), **writes}) if writes else state
    plan = conditions.written(plan, state.conditions, now=now, generation=generation)
    if kinds and kinds != ["PatchStatus"] or "Emit" in kinds:
        log.info("%s/%s attempt %d: %s", namespace, name, state.attempt, ", ".join(kinds))
        for said in plan.actions:  # the Events' reasons: why it acts, in its own log too
            if isinstance(said, Emit):
                log.info("%s/%s: %s: %s", namespace, name, said.reason, said.message)
    elif plan.note:
        log.debug("%s/%s: %s", namespace, name, plan.note)
    # render and apply
    target = Target(
        body=body,
        spec=spec,
        uri=uri,
        cache_token=job_token(op.config.job_key, namespace, name, uid),
        network_policy=op.config.network_policy,
    )
    outcome = apply(
        render_plan(plan, target),
        op.api,
        resource_version=rv,
        on_applied=lambda action: op.metrics.record(namespace, name, action),
    )
    if outcome.resource_version != rv:  # a body older than our own writes is not acted on
        op.written[uid] = outcome.resource_version
        if op.channel is not None and spec is not None and not outcome.stale:
            op.channel.want(key, JobAsk.for_job(uid, name, spec, after))  # said to them at once
    if outcome.refused:  # the next reconcile ends the attempt with the API's reason
        log.warning("%s/%s: the attempt's objects were rejected: %s", namespace, name,
                    outcome.refused)  # fmt: skip
        created = next(a for a in plan.actions if isinstance(a, CreateAttempt))
        op.refused[uid] = (created.attempt, outcome.refused)
    if outcome.namespace_terminating:
        log.info("%s/%s: namespace terminating, nothing started", namespace, name)
    if outcome.stale:
        log.info("%s/%s: the job changed since it was read; deciding again", namespace, name)
