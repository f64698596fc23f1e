"""One job through a node loss, its return, a resize, a suspend and a delete, on simulated nodes:
the scenario the e2e tier runs on kind (ctj_stack.scenario.Lifecycle), plus what only
this tier can see (the operator's own /metrics, the logs of pods already gone, the node
caches' share of a restore).

It replaced five tests that each ran a job of their own (a job that checkpoints, node
loss and return, `kubectl scale`, a 3 -> 2 resize that loses no step, deletion): one job
now goes through all of it here, and the same steps run on kind.
"""

from __future__ import annotations

import pytest
from ctj_devcluster import Cluster
from ctj_stack.jobs import OperatorProcess, attempt_of, metric_value, rank0_events
from ctj_stack.scenario import Lifecycle
from ctj_stack.simulated import SimulatedStack

from tests.cluster.test_operator_transitions import assert_planned_handover

pytestmark = pytest.mark.cluster

# a checkpoint every 10 steps, one a second; no end within the test
TRAINING = {"CTJ_TOTAL_STEPS": "1000000", "CTJ_STEP_DELAY_S": "0.1"}


def test_one_job_through_a_node_loss_its_return_a_resize_a_suspend_and_a_delete(
    op_cluster: Cluster,
    operator: OperatorProcess,
    job_namespace: str,
    s3_uri: str,
    s3_env: dict[str, str],
) -> None:
    ns, name = job_namespace, "elastic"
    sim = SimulatedStack(op_cluster, operator, s3_uri, s3_env["AWS_ENDPOINT_URL"])
    # a 3 s scale-up window (the example's 30 s would only be waited out)
    scenario = Lifecycle(sim, ns, name, training=TRAINING,
                         spec={"scaleUp": {"stabilizationSeconds": 3}})  # fmt: skip

    scenario.commits_checkpoints()
    pods = sim.attempt_pods(ns, name, 1)
    assert sorted(p.metadata.name for p in pods) == [f"{name}-a1-{r}" for r in range(3)]
    assert all(p.metadata.owner_references[0].controller for p in pods)
    service = sim.core.read_namespaced_service(name, ns)
    assert service.metadata.owner_references[0].name == name

    loss = scenario.loses_a_node()
    # resharded 3 -> 2 from a checkpoint attempt 1 staged (the periodic ones: every 10)
    staged_in_1 = {e["step"] for e in sim.trainer_events(ns, f"{name}-a1-0")
                   if e["event"] == "staged"}  # fmt: skip
    assert loss.restored["step"] in staged_in_1 and loss.restored["step"] % 10 == 0
    # the node tier is the node agents' (a DaemonSet: the e2e tier runs it on kind and
    # checks the survivors' share comes from them); the simulated nodes run none, so here
    # every byte comes from S3 and an absent agent costs only speed
    tiers = loss.restored["bytes_by_tier"]
    assert tiers == {"s3": loss.restored["bytes_fetched"]}, tiers
    recoveries = sim.wait(
        lambda: metric_value(operator.metrics(), "ctj_job_recovery_seconds_count"),
        "a recovery observation in the operator's /metrics",
        15,
    )
    assert recoveries >= 1

    # a commit at world 2, so that growing back shows a planned transition's own save
    attempt_2 = scenario.attempt
    sim.wait(
        lambda: any(
            e["event"] == "committed" for e in rank0_events(op_cluster, ns, name, attempt_2)
        ),
        "a commit at world size 2",
        60,
    )
    scenario.node_returns()
    # growing is planned: attempt 2 saved the step it stopped at; attempt 3 restored
    # exactly it, and its samples continue exactly
    assert_planned_handover(op_cluster, ns, name, 3, before=2)
    planned = metric_value(
        operator.metrics(), "ctj_job_restarts_total", reason="ScaleUp", cause="planned"
    )
    assert planned == 1
    sim.wait(
        lambda: all(attempt_of(p) == scenario.attempt for p in sim.pods(ns, name)),
        "no pod of an older attempt left",
        30,
    )

    scenario.resized()  # 3 -> 2, planned too
    assert_planned_handover(op_cluster, ns, name, 2, before=3)

    # suspended (every pod gone, nothing counted) and resumed at 3: attempt 4 saved the
    # step it stopped at; attempt 5 restored exactly it, resharded 2 -> 3
    scenario.suspended_and_resumed()
    assert scenario.attempt == 5
    assert_planned_handover(op_cluster, ns, name, 3, before=4)
    assert (
        metric_value(
            operator.metrics(), "ctj_job_restarts_total", reason="Suspended", cause="planned"
        )
        == 0
    ), "a suspend is no restart"
    wide = sim.kubectl("get", f"ctj/{name}", "-n", ns, "-o", "wide").splitlines()
    assert "Running" in wide[1]

    scenario.deleted()
