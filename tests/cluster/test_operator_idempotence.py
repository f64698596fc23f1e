"""Killing the operator in the middle of a restart: started again, it converges.

The operator writes status before acting, so wherever it dies the next one reads
what was under way and finishes it: no duplicate pods, no pods of an older attempt
left, the restart counted once. The kills land at the moments that matter: right
as phase Restarting is written (SIGKILL on seeing it), right as the next attempt is
written, and exactly between writing Restarting and tearing the gang down (the
operator is stopped and that status is written for it).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Cluster
from ctj_stack.jobs import (
    FAST_TRAINING,
    NewJob,
    OperatorProcess,
    attempt_of,
    core,
    custom,
    get_job,
    job_pods,
    running,
    status,
    wait_for,
    wait_for_status,
)

pytestmark = pytest.mark.cluster


class PodCensus:
    """Samples the job's pods every 50 ms: the most pods any attempt had at once."""

    def __init__(self, cluster: Cluster, namespace: str, name: str) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.most: dict[int, int] = defaultdict(int)
        self.world: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        api = core(self.cluster)
        selector = f"{GROUP}/job-name={self.name}"
        while not self._stop.is_set():
            per_attempt: dict[int, int] = defaultdict(int)
            for pod in api.list_namespaced_pod(self.namespace, label_selector=selector).items:
                attempt = attempt_of(pod)
                per_attempt[attempt] += 1
                self.world[attempt] = int(pod.metadata.labels[f"{GROUP}/world-size"])
            for attempt, n in per_attempt.items():
                self.most[attempt] = max(self.most[attempt], n)
            time.sleep(0.05)

    @classmethod
    @contextlib.contextmanager
    def watching(cls, cluster: Cluster, namespace: str, name: str) -> Iterator[PodCensus]:
        census = cls(cluster, namespace, name)
        census._thread.start()
        try:
            yield census
        finally:
            census._stop.set()
            census._thread.join(5)


def test_operator_killed_during_restarts_converges_without_duplicates(
    op_cluster: Cluster, operator: OperatorProcess, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "phoenix"
    new_job(name, env=FAST_TRAINING, restartPolicy={"maxRestarts": 5, "backoffSeconds": 0.5})
    with PodCensus.watching(op_cluster, ns, name) as census:
        wait_for(lambda: running(op_cluster, ns, name, 1, 3), "attempt 1 at world size 3", 90)

        # 1. a rank's pod is deleted; SIGKILL the operator as soon as it says Restarting,
        #    and again as soon as it writes attempt 2
        #    (the operator holds Restarting for a moment only, the survivors staying: a
        #    watch from before the deletion sees it where a poll can miss it)
        before = get_job(op_cluster, ns, name)["metadata"]["resourceVersion"]
        core(op_cluster).delete_namespaced_pod(f"{name}-a1-1", ns)
        wait_for_status(
            op_cluster,
            ns,
            name,
            lambda st: st.get("phase") == "Restarting" and st.get("attempt") == 1,
            "Restarting",
            since=before,
        )
        operator.kill()
        operator.start()
        wait_for(lambda: status(op_cluster, ns, name).get("attempt") == 2, "attempt 2", 60)
        operator.kill()
        operator.start()
        st = wait_for(lambda: running(op_cluster, ns, name, 2, 3), "attempt 2 running", 90)
        # a deleted pod is the cluster's doing, not the job's: counted once, apart
        assert (st["nodeRestarts"], st["restarts"]) == (1, 0), "one failure, counted once"
        # and the survivors restarted in place across both kills (status.survivors, then
        # status.carried, told the next operator which pods to keep)
        assert st["carried"] == [f"{name}-a1-0", f"{name}-a1-2"], st

        # 2. dead exactly between writing Restarting and tearing attempt 2 down
        operator.kill()
        custom(op_cluster).patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            ns,
            PLURAL,
            name,
            {
                "status": {
                    "phase": "Restarting",
                    "restarts": 2,
                    "podsCreated": False,
                    "tornDown": False,
                    "teardownSince": time.time(),
                    "notBefore": time.time(),
                    "failureSeenAt": time.time(),
                }
            },
        )
        operator.start()
        st = wait_for(lambda: running(op_cluster, ns, name, 3, 3), "attempt 3 running", 120)
        assert st["restarts"] == 2
        wait_for(
            lambda: all(attempt_of(p) == 3 for p in job_pods(op_cluster, ns, name)),
            "no pod of an older attempt left",
            60,
        )
    assert set(census.most) == {1, 2, 3}
    for attempt, most in census.most.items():
        assert most <= census.world[attempt], f"attempt {attempt}: {most} pods at once"
