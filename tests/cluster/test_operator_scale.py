"""`kubectl scale ctj/NAME` resizes a running job through the scale subresource."""

from __future__ import annotations

import pytest
from ctj_devcluster import Cluster
from ctj_stack.jobs import (
    FAST_TRAINING,
    NewJob,
    committed_steps,
    job_events,
    running,
    trainer_events,
    wait_for,
)

pytestmark = pytest.mark.cluster


def test_kubectl_scale_restarts_the_job_at_the_new_size(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "resized"
    new_job(name, env=FAST_TRAINING)
    wait_for(lambda: running(op_cluster, ns, name, 1, 3), "attempt 1 at world size 3", 90)
    committed = wait_for(lambda: committed_steps(op_cluster, ns, f"{name}-a1-0"), "a commit", 120)

    op_cluster.kubectl("scale", f"ctj/{name}", "--replicas=2", "-n", ns)
    st = wait_for(lambda: running(op_cluster, ns, name, 2, 2), "attempt 2 at world size 2", 90)
    assert st["restarts"] == 0, "a resize is not a failure"
    assert {c["type"]: c for c in st["conditions"]}["Restarted"]["reason"] == "Resize"
    assert "Resize" in {e.reason for e in job_events(op_cluster, ns, name)}
    shown = op_cluster.kubectl("get", f"ctj/{name}", "-n", ns, "-o", "wide").stdout
    assert "Running" in shown.splitlines()[1]

    def restored() -> object:
        events = trainer_events(op_cluster, ns, f"{name}-a2-0")
        found = [e for e in events if e["event"] == "restored"]
        steps = [e for e in events if e["event"] == "step"]
        return found and steps and (found[0], steps[0])

    first_restore, first_step = wait_for(restored, "attempt 2 to restore and train", 90)
    assert first_restore["world_size"] == 2 and first_restore["step"] >= committed[-1]
    assert first_step["step"] == first_restore["step"] + 1
