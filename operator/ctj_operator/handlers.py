"""kopf's handlers: the watches into indexes, and a timer per job that reconciles it.

Pods and nodes reach the operator through kopf indexes (one watch per kind, for all
jobs), so a job's reconcile (reconcile.py) reads memory; the pod watch also tells the
heartbeat channel (heartbeats.py) where each rank runs. Every handler is a plain
function of what kopf passes it; the operator's state is the ``Operator`` that
``__main__`` hands kopf as ``memo.operator`` (runtime.py).

Every selector names its API group and version: kopf then reads the discovery of those
groups alone at start-up, where a bare "pods" would make it read every group the cluster
serves, and a broken aggregated API of another product (an APIService answering 503 or
404, e.g. a metrics or visibility server down) would keep the operator from starting.

The indexes are async (quick, pure) so they run on kopf's event loop: as sync handlers
they would queue behind reconciles blocked on API calls in the thread pool, and a pod the
operator has just created would stay unseen for tens of seconds under load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf
from ctj_contract import GROUP, LABEL_ATTEMPT, LABEL_JOB, PLURAL, VERSION

from . import capacity, queue
from .builders import CONTROLLED, controller_failure
from .decisions import TERMINAL
from .observe import Indexes, node_summary, pod_summary
from .reconcile import reconcile
from .runtime import Operator
from .spec import Backend


def _operator(memo: kopf.Memo) -> Operator:
    op: Operator = memo["operator"]
    return op


# ---- indexes: what the watches deliver, kept by kopf in memory ----


@kopf.index("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def ctj_pods(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, memo: kopf.Memo, **_: Any
) -> Any:
    summary = pod_summary(body)
    op = _operator(memo)
    op.marks.phases.see((namespace, summary["name"]), summary["phase"])
    if op.channel is not None and namespace is not None:
        op.channel.track(namespace, labels[LABEL_JOB], summary)
    return {(namespace, labels[LABEL_JOB]): summary}


@kopf.index("v1", "pods")
async def node_usage(
    namespace: str | None, labels: Mapping[str, str], spec: kopf.Spec, status: kopf.Status, **_: Any
) -> Any:
    """What every non-terminal pod bound to a node requests (the node's room taken)."""
    node = spec.get("nodeName")
    if not node or status.get("phase") in TERMINAL:
        return None
    job = (namespace, labels.get(LABEL_JOB)) if labels.get(LABEL_JOB) else None
    return {node: (job, capacity.pod_requests(dict(spec)))}


@kopf.index("v1", "nodes")
async def cluster_nodes(name: str, body: kopf.Body, **_: Any) -> Any:
    return {name: node_summary(body)}


def _attempt_entry(namespace: str | None, labels: Mapping[str, str], body: kopf.Body) -> Any:
    """An attempt's PyTorchJob or TrainJob: (attempt, why its controller failed it, or "")."""
    attempt = int(labels.get(LABEL_ATTEMPT, "0"))
    return {(namespace, labels[LABEL_JOB]): (attempt, controller_failure(dict(body)))}


async def ctj_pytorchjobs(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> Any:
    return _attempt_entry(namespace, labels, body)


async def ctj_trainjobs(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> Any:
    return _attempt_entry(namespace, labels, body)


_ATTEMPT_INDEXES = {Backend.PYTORCHJOB: ctj_pytorchjobs, Backend.TRAINJOB: ctj_trainjobs}
"""The index of each backend of CONTROLLED (kopf passes it by the function's name)."""


async def ctj_workloads(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> Any:
    """Registered by ``register_kueue`` where Kueue's API is served: each job's Workload."""
    return {(namespace, labels[LABEL_JOB]): queue.workload_view(body)}


async def kueue_flavors(name: str, body: kopf.Body, **_: Any) -> Any:
    return {name: queue.flavor_of(body)}


async def kueue_priorities(name: str, body: kopf.Body, **_: Any) -> Any:
    return {name: int(body.get("value") or 0)}


def register_kueue() -> None:
    """Kueue's Workloads (those of our jobs), ResourceFlavors and WorkloadPriorityClasses."""
    g, v = queue.GROUP, queue.VERSION
    kopf.index(g, v, queue.WORKLOADS, labels={LABEL_JOB: kopf.PRESENT})(ctj_workloads)
    kopf.index(g, v, "resourceflavors")(kueue_flavors)
    kopf.index(g, v, "workloadpriorityclasses")(kueue_priorities)


def register_attempts(backend: Backend) -> None:
    """Watches the backend's PyTorchJobs or TrainJobs (those of our jobs), where its CRD
    is served at start-up."""
    at = CONTROLLED[backend]
    kopf.index(at.group, at.version, at.plural, labels={LABEL_JOB: kopf.PRESENT})(
        _ATTEMPT_INDEXES[backend]
    )


# The indexes forget a deleted object by themselves; these marks go with it (the same
# watch streams: kopf serves every handler of a resource from one).


@kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_gone(
    event: kopf.RawEvent, namespace: str | None, name: str, memo: kopf.Memo, **_: Any
) -> None:
    if event["type"] == "DELETED":
        op = _operator(memo)
        op.marks.phases.drop((namespace, name))
        op.marks.beats.drop((namespace, name))
        op.marks.tracked.drop((namespace, name))
        if op.channel is not None and namespace is not None:
            op.channel.untrack(namespace, name)


# ---- the jobs ----


RECONCILE_S = 0.5
"""The reconcile timer's default period (the operator's ``--reconcile-interval``). A
recovery waits for a tick twice: to judge a silence past the heartbeat timeout and to
start the next attempt once the last one is torn down; 0.5 s took the second from 1.1 to
0.6 s against 1 s. A tick reads memory and sends no request, but costs about 1 ms of CPU
per job: 13% of one core at 50 jobs, against 8% at 1 s (docs/benchmarks.md)."""


def reconcile_job(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """kopf passes each index by its function's name (registered by ``register_reconcile``)."""
    indexes = Indexes(
        pods=kwargs["ctj_pods"],
        usage=kwargs["node_usage"],
        nodes=kwargs["cluster_nodes"],
        attempts={
            backend: kwargs[index.__name__]
            for backend, index in _ATTEMPT_INDEXES.items()
            if kwargs.get(index.__name__) is not None
        },
        workloads=kwargs.get("ctj_workloads"),
        flavors=kwargs.get("kueue_flavors") or {},
        priorities=kwargs.get("kueue_priorities") or {},
    )
    reconcile(_operator(memo), body, indexes)


def register_reconcile(interval_s: float = RECONCILE_S) -> None:
    """The timer per job that reconciles it, every ``interval_s`` seconds."""
    timer = kopf.timer(GROUP, VERSION, PLURAL, id="reconcile", interval=interval_s,
                       initial_delay=0.0)  # fmt: skip
    timer(reconcile_job)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(name: str, namespace: str | None, uid: str, memo: kopf.Memo, **_: Any) -> None:
    """A deleted job leaves no series behind (its objects go by garbage collection)."""
    assert namespace is not None  # the CRD is namespaced
    op = _operator(memo)
    op.metrics.job_phase(namespace, name, None)
    op.forget(uid)
    if op.channel is not None:
        op.channel.forget_job((namespace, name))
