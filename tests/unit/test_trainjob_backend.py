"""Backend trainjob: each attempt is a Kubeflow Trainer v2 TrainJob with a TrainingRuntime
of its own, built without a cluster; what the Trainer and JobSet controllers read, what
each rank's pod sees, and how the operator finds, tears down and names it."""

from __future__ import annotations

from typing import Any

import pytest
from ctj_contract import LABEL_ATTEMPT, LABEL_JOB, LABEL_WORLD
from ctj_operator import builders, render
from ctj_operator.decisions import CreateAttempt, DeleteAttempt
from ctj_operator.names import Rule, derived_names, max_name_length
from ctj_operator.observe import node_rank
from ctj_operator.spec import Backend

from .test_operator_builders import BODY, URI, cached_spec, env_of, job_spec

INDEX = {
    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
}


def trainjob(world_size: int = 3, attempt: int = 2, **overrides: Any) -> tuple[dict, dict]:
    spec = job_spec(backend="trainjob", **overrides)
    return builders.build_trainjob(BODY, spec, uri=URI, attempt=attempt, world_size=world_size)


def pod_template(runtime: dict[str, Any]) -> dict[str, Any]:
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return dict(replicated["template"]["spec"]["template"])


def test_the_trainjob_runs_its_own_runtime_at_the_attempts_world_size() -> None:
    runtime, job = trainjob(world_size=3)
    assert (runtime["kind"], job["kind"]) == ("TrainingRuntime", "TrainJob")
    assert runtime["apiVersion"] == job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert runtime["metadata"]["name"] == job["metadata"]["name"] == "demo-a2"
    assert job["spec"]["runtimeRef"] == {
        "name": "demo-a2", "apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
    }  # fmt: skip
    assert job["spec"]["trainer"] == {"numNodes": 3}
    # no torch policy: it would fix MASTER_PORT at 29400 for every attempt
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 3}
    for obj in (runtime, job):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert obj["metadata"]["labels"] == {
            LABEL_JOB: "demo",
            LABEL_ATTEMPT: "2",
            LABEL_WORLD: "3",
        }
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]  # our Workload queues


def test_what_trainer_and_jobset_require_and_no_pod_is_replaced() -> None:
    """Trainer's webhook: the "trainer" ancestor is one replicated job whose pods have a
    container named "node". The Job controller replaces no failed pod and keeps the other
    ranks running (backoffLimitPerIndex 0): ending the attempt is the operator's."""
    runtime, _ = trainjob()
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == "node" and replicated["replicas"] == 1
    labels = replicated["template"]["metadata"]["labels"]
    assert labels == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    indexed = replicated["template"]["spec"]
    assert indexed["completionMode"] == "Indexed"
    assert indexed["backoffLimitPerIndex"] == 0 and indexed["podReplacementPolicy"] == "Failed"
    assert "backoffLimit" not in indexed  # with a per-index limit the API defaults it
    pod = pod_template(runtime)
    assert pod["spec"]["containers"][0]["name"] == "node"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["initContainers"][-1]["name"] == "ctj-sidecar"
    assert pod["metadata"]["labels"]["team"] == "ml"  # the template's, and ours
    assert pod["metadata"]["labels"][LABEL_JOB] == "demo"


def test_each_rank_reads_its_node_rank_from_its_completion_index() -> None:
    """One template for every rank: the rank is the pod's index in its Indexed Job."""
    runtime, _ = trainjob(nprocPerNode=1)
    spec = pod_template(runtime)["spec"]
    env = env_of(spec["containers"][0])
    assert env["NODE_RANK"] == env["PET_NODE_RANK"] == env["RANK"] == INDEX
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "demo-a2-node-0-0.demo-a2"
    assert env["MASTER_PORT"] == str(builders.master_port(2))
    assert (env["WORLD_SIZE"], env["PET_NNODES"], env["CTJ_ATTEMPT"]) == ("3", "3", "2")
    assert env["WORLD_SIZE"] != "999"  # ours win over the template's
    sidecar = env_of(spec["initContainers"][-1])
    assert sidecar["NODE_RANK"] == INDEX and sidecar["CTJ_ATTEMPT"] == "2"
    assert sidecar["CTJ_CACHE_TOKEN"] == {
        "secretKeyRef": {"name": "demo-ctj-cache", "key": "token"}
    }


def test_with_several_ranks_per_pod_torchrun_sets_each_processes_rank() -> None:
    runtime, _ = trainjob(nprocPerNode=2)
    env = env_of(pod_template(runtime)["spec"]["containers"][0])
    assert "RANK" not in env and env["PET_NODE_RANK"] == INDEX
    assert (env["WORLD_SIZE"], env["PET_NPROC_PER_NODE"]) == ("6", "2")


def test_peers_are_the_ranks_jobset_hostnames() -> None:
    spec = cached_spec("trainjob")
    runtime, _ = builders.build_trainjob(BODY, spec, uri=URI, attempt=1, world_size=3)
    env = env_of(pod_template(runtime)["spec"]["containers"][0])
    assert env["CTJ_CACHE_PEERS"] == (
        "demo-a1-node-0-0.demo-a1:9402,demo-a1-node-0-1.demo-a1:9402,demo-a1-node-0-2.demo-a1:9402"
    )


def test_a_trainjob_pod_is_read_as_its_completion_index() -> None:
    assert node_rank({LABEL_JOB: "demo", "batch.kubernetes.io/job-completion-index": "2"}) == 2
    assert builders.rank_pod_name(job_spec(backend="trainjob"), "demo", 4, 1) == "demo-a4-node-0-1"


def test_an_attempt_is_made_runtime_first_and_torn_down_trainjob_first() -> None:
    target = render.Target(body=BODY, spec=job_spec(backend="trainjob"), uri=URI)
    calls = render.render(CreateAttempt(attempt=2, world_size=3), target)
    kinds = [c.kind for c in calls if c.verb == render.Verb.CREATE]
    assert kinds[-2:] == [render.Kind.TRAINING_RUNTIME, render.Kind.TRAINJOB]
    assert render.Kind.POD not in kinds and render.Kind.SERVICE not in kinds  # JobSet's
    gone = render.render(DeleteAttempt(attempt=2), target)
    assert [(c.verb, c.kind, c.name) for c in gone] == [
        (render.Verb.DELETE, render.Kind.TRAINJOB, "demo-a2"),
        (render.Verb.DELETE, render.Kind.TRAINING_RUNTIME, "demo-a2"),
    ]


@pytest.mark.parametrize("rank", [0, 99_998])
def test_the_longest_name_fits_every_name_jobset_derives(rank: int) -> None:
    name = "x" * max_name_length(Backend.TRAINJOB)
    found = derived_names(name, Backend.TRAINJOB, attempt=999_999_999, rank=rank)
    assert all(d.rule.problem(d.value) is None for d in found), found
    hostname = builders.trainjob_hostname(name, 999_999_999, rank)
    assert Rule.DNS1123_LABEL.problem(hostname) is None
