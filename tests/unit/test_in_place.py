"""In-place restart, as the operator decides and renders it: survivors keep their pods.

An unplanned end keeps every pod running under the launcher on a trusted node; the next
attempt relabels them as node ranks 0..k-1 (their launchers restart the workers on the
assignment the heartbeat carries) and creates only the missing ranks. docs/operator.md,
"In-place restart", states the rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ctj_contract import LABEL_ATTEMPT, LABEL_RANK, LABEL_SPARE, LABEL_WORLD
from ctj_contract.launch import LAUNCHER_MODULE, WorkerExit
from ctj_operator import builders
from ctj_operator.decisions import (
    CreateAttempt,
    CreateSpares,
    DeletePods,
    JobState,
    NodeView,
    PatchStatus,
    PodView,
    job_state,
)
from ctj_operator.heartbeats import HeartbeatChannel, JobAsk, Rank
from ctj_operator.observe import Freshness, pod_view
from ctj_operator.render import Kind, Target, Verb, render
from ctj_operator.spec import JobSpec, SpecError

from .test_decisions import RUNNING3, decide, nodes, observe, spec

COMMAND = {"name": "trainer", "image": "x", "command": ["python", "train.py"], "args": ["--lr=1"]}
LAUNCHED = {"spec": {"containers": [COMMAND]}}
BODY = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}}


def in_place(**kw: Any) -> JobSpec:
    return spec(template=LAUNCHED, **kw)


def ranks(n: int, attempt: int = 1, phase: str = "Running", **kw: Any) -> list[PodView]:
    return [
        PodView(f"a{attempt}-{i}", attempt, i, phase, f"n{i}", relaunchable=True, **kw)
        for i in range(n)
    ]


RUNNING = RUNNING3


def test_only_pods_the_launcher_can_restart_in_place_are_kept() -> None:
    assert in_place().relaunches
    assert not spec().relaunches, "no command in the template: the image's entrypoint runs"
    assert not in_place(restartPolicy={"inPlace": False}).relaunches
    assert not in_place(backend="pytorchjob").relaunches


def test_a_lost_node_replaces_its_rank_only_and_the_next_attempt_carries_the_survivors() -> None:
    the_nodes = [
        NodeView("n0", True),
        NodeView("n1", False),
        NodeView("n2", True),
        NodeView("n3", True),
    ]
    ended = decide(observe(RUNNING, ranks(3), the_nodes, now=5.0, job=in_place()))
    assert ended.status()["survivors"] == ["a1-0", "a1-2"]
    deleted = [a for a in ended.actions if isinstance(a, DeletePods)]
    assert [d.names for d in deleted] == [("a1-1",)] and deleted[0].force, "only the lost one"

    state = job_state(ended.status() | {"worldSize": 3, "attempt": 1, "conditions": []})
    survivors = [p for p in ranks(3) if p.name != "a1-1"]
    started = decide(observe(state, survivors, the_nodes, now=6.0, job=in_place()))
    (create,) = [a for a in started.actions if isinstance(a, CreateAttempt)]
    assert create == CreateAttempt(2, 3, ("n1",), ("a1-0", "a1-2"))
    assert started.status()["carried"] == ["a1-0", "a1-2"]
    assert started.status()["survivors"] is None
    assert not [a for a in started.actions if isinstance(a, DeletePods)]


def test_a_crash_keeps_every_pod_and_its_own_too() -> None:
    crashed = [*ranks(2), *ranks(3)[2:]]
    worker_failed = PodView(
        "a1-2", 1, 2, "Failed", "n2", exit="trainer exited 1", relaunchable=True, phase_age=1.0
    )
    beats = {0: 0.1, 1: 0.1, 2: 0.1}
    plan = decide(
        observe(RUNNING, [*crashed[:2], worker_failed], nodes(3), job=in_place(), beats=beats)
    )
    assert plan.status()["survivors"] == ["a1-0", "a1-1", "a1-2"]
    messages = [c["message"] for c in plan.status()["conditions"]]
    assert any("trainer exited 1" in m for m in messages), messages
    assert not [a for a in plan.actions if isinstance(a, DeletePods)], "nothing deleted"


def test_a_hung_rank_is_replaced_and_a_planned_end_keeps_nothing() -> None:
    hung = decide(
        observe(
            RUNNING,
            ranks(3),
            nodes(3),
            job=in_place(),
            trainers={1: 9.0},
            beats={0: 0.1, 1: 0.1, 2: 0.1},
        )
    )
    assert hung.status()["survivors"] == ["a1-0", "a1-2"]
    assert [(d.names, d.force) for d in hung.actions if isinstance(d, DeletePods)] == [
        (("a1-1",), True)
    ]

    resize = decide(observe(RUNNING, ranks(3), nodes(3), job=in_place(replicas=2)))
    assert "survivors" not in resize.status(), "a planned transition checkpoints and stops"


def test_no_survivor_without_in_place() -> None:
    the_nodes = [NodeView("n0", True), NodeView("n1", False), NodeView("n2", True)]
    plan = decide(observe(RUNNING, ranks(3), the_nodes, job=spec()))
    assert plan.status()["survivors"] is None
    assert sorted(n for d in plan.actions if isinstance(d, DeletePods) for n in d.names) == [
        "a1-0",
        "a1-1",
        "a1-2",
    ]


def test_a_survivor_lost_before_the_next_attempt_is_not_carried_and_extra_ones_go() -> None:
    state = JobState(
        phase="Restarting", attempt=1, world_size=3, survivors=("a1-0", "a1-2"), not_before=0.0
    )
    gone_bad = [ranks(3)[0], PodView("a1-2", 1, 2, "Failed", "n2", relaunchable=False)]
    plan = decide(observe(state, gone_bad, nodes(3), now=1.0, job=in_place()))
    assert [a.names for a in plan.actions if isinstance(a, DeletePods)] == [("a1-2",)]
    assert not [a for a in plan.actions if isinstance(a, CreateAttempt)], "it must go first"

    shrink = decide(
        observe(
            state,
            [ranks(3)[0], ranks(3)[2]],
            nodes(3),
            now=1.0,
            job=in_place(replicas=1, minReplicas=1),
        )
    )
    (create,) = [a for a in shrink.actions if isinstance(a, CreateAttempt)]
    assert create.carried == ("a1-0",) and create.world_size == 1
    assert ("a1-2",) in [a.names for a in shrink.actions if isinstance(a, DeletePods)]


def test_carried_pods_are_not_older_and_one_gone_ends_the_attempt_at_once() -> None:
    state = JobState(
        phase="Running",
        attempt=2,
        world_size=2,
        pods_created=True,
        attempt_started=0.0,
        carried=("a1-0",),
    )
    relabel_pending = [ranks(1)[0], *ranks(2, attempt=2)[1:]]  # a1-0 still labelled attempt 1
    plan = decide(observe(state, relabel_pending, nodes(3), now=1.0, job=in_place()))
    assert not [a for a in plan.actions if isinstance(a, DeletePods)], "not deleted as older"

    gone = decide(observe(state, ranks(2, attempt=2)[1:], nodes(3), now=1.0, job=in_place()))
    assert gone.status()["phase"] == "Restarting"
    assert "a1-0" in gone.status()["conditions"][0]["message"]


def test_creating_an_attempt_relabels_the_carried_pods_before_creating_the_rest() -> None:
    target = Target(body=BODY, spec=in_place(), uri="s3://b/p")
    calls = render(CreateAttempt(2, 3, (), ("demo-a1-0", "demo-a1-2")), target)
    pods = [c for c in calls if c.kind == Kind.POD]
    assert [(c.verb, c.name or c.body["metadata"]["name"]) for c in pods] == [
        (Verb.PATCH, "demo-a1-0"),
        (Verb.PATCH, "demo-a1-2"),
        (Verb.CREATE, "demo-a2-2"),
    ]
    labels = pods[1].body["metadata"]["labels"]
    assert (labels[LABEL_ATTEMPT], labels[LABEL_RANK], labels[LABEL_WORLD]) == ("2", "1", "3")
    created = pods[2].body["spec"]
    env = {e["name"]: e.get("value") for e in created["containers"][0]["env"]}
    assert (
        env["MASTER_ADDR"] == "demo-a1-0.demo" and env["RANK"] == "2" and env["CTJ_ATTEMPT"] == "2"
    )
    sidecar_env = {e["name"]: e.get("value") for e in created["initContainers"][-1]["env"]}
    peers = sidecar_env.get("CTJ_CACHE_PEERS")
    assert peers is None or peers.split(",")[0].startswith("demo-a1-0.demo:")


def test_the_trainer_runs_under_the_launcher_with_its_command_and_args() -> None:
    pod = builders.build_pod(BODY, in_place(), uri="u", attempt=1, world_size=1, node_rank=0)
    trainer = pod["spec"]["containers"][0]
    assert trainer["command"] == [
        "python",
        "-m",
        LAUNCHER_MODULE,
        "--",
        "python",
        "train.py",
        "--lr=1",
    ]
    assert "args" not in trainer
    plain = builders.build_pod(BODY, spec(), uri="u", attempt=1, world_size=1, node_rank=0)
    assert "command" not in plain["spec"]["containers"][0]


def test_the_heartbeat_assigns_each_current_rank_its_place() -> None:
    state = JobState(phase="Running", attempt=4, world_size=2, carried=("demo-a3-1",))
    job = JobAsk.of("u-1", state, 1.0, job="demo", nproc=2, relaunches=True)
    ask = job.ask_for(Rank(("ml", "demo"), "demo-a3-1", "10.0.0.1", 4, 0))
    assert ask.assignment is not None
    assert ask.assignment.environment()["MASTER_ADDR"] == "demo-a3-1.demo"
    assert ask.assignment.environment()["WORLD_SIZE"] == "4"
    assert ask.assignment.master_port == builders.master_port(4)
    older = job.ask_for(Rank(("ml", "demo"), "demo-a2-0", "10.0.0.2", 3, 0))
    assert older.assignment is None and older.ended
    restarting = JobAsk.of(
        "u-1",
        JobState(phase="Restarting", attempt=4, world_size=2),
        1.0,
        job="demo",
        relaunches=True,
    )
    assert restarting.ask_for(Rank(("ml", "demo"), "p", "ip", 4, 0)).assignment is None
    off = JobAsk.of("u-1", state, 1.0, job="demo")
    assert off.ask_for(Rank(("ml", "demo"), "p", "ip", 4, 0)).assignment is None


def test_a_worker_exit_reads_as_a_failed_rank_that_can_still_restart_in_place() -> None:
    summary = {
        "name": "demo-a1-0",
        "attempt": 1,
        "rank": 0,
        "phase": "Running",
        "node": "n0",
        "terminating": False,
        "reason": None,
        "waiting": "",
        "launcher": True,
    }
    view = pod_view(summary, 30.0, worker=(WorkerExit(1, 3), 0.5))
    assert (view.phase, view.exit, view.phase_age, view.relaunchable) == (
        "Failed",
        "trainer exited 3",
        0.5,
        True,
    )
    stale = pod_view(summary, 30.0, worker=(WorkerExit(0, 3), 0.5))
    assert stale.phase == "Running", "an exit of the attempt before is not this one's"
    plain = pod_view({**summary, "launcher": False}, 30.0)
    assert not plain.relaunchable


def test_a_changed_ask_goes_to_the_jobs_ranks_at_once_not_at_their_next_beat() -> None:
    channel = HeartbeatChannel(b"k" * 32, Freshness())
    pod = {"name": "demo-a1-0", "phase": "Running", "ip": "10.0.0.1", "attempt": 1, "rank": 0}
    channel.track("ml", "demo", pod)
    other = {**pod, "name": "other-a1-0", "ip": "10.0.0.2"}
    channel.track("ml", "other", other)
    running = JobState(phase="Running", attempt=1, world_size=1)
    channel.want(("ml", "demo"), JobAsk.of("u-1", running, 1.0, job="demo", relaunches=True))
    channel._due = {key: 1e18 for key in channel._due}  # every rank just asked
    channel.want(("ml", "demo"), JobAsk.of("u-1", running, 1.0, job="demo", relaunches=True))
    assert channel._due[("ml", "demo-a1-0")] == 1e18, "the same ask waits for the period"
    ended = JobState(phase="Restarting", attempt=1, world_size=1)
    channel.want(("ml", "demo"), JobAsk.of("u-1", ended, 1.0, job="demo", relaunches=True))
    assert channel._due[("ml", "demo-a1-0")] == 0.0, "an attempt's end is said at once"
    assert channel._due[("ml", "other-a1-0")] == 1e18, "to that job's ranks only"


def spare(name: str, node: str, phase: str = "Running", **kw: Any) -> PodView:
    return PodView(name, 0, 0, phase, node, relaunchable=phase == "Running", spare=True, **kw)


def test_a_spare_takes_the_lost_rank_at_the_same_world_size() -> None:
    the_nodes = [NodeView(n, n != "n1") for n in ("n0", "n1", "n2", "n3")]
    warm = spare("job-a1-s0", "n3")
    ended = decide(observe(RUNNING, [*ranks(3), warm], the_nodes, job=in_place(spares=1)))
    assert ended.status()["survivors"] == ["a1-0", "a1-2"]
    assert "job-a1-s0" not in [
        n for d in ended.actions if isinstance(d, DeletePods) for n in d.names
    ]

    state = job_state(ended.status() | {"worldSize": 3, "attempt": 1, "conditions": []})
    survivors = [p for p in ranks(3) if p.name != "a1-1"]
    started = decide(observe(state, [*survivors, warm], the_nodes, job=in_place(spares=1)))
    (create,) = [a for a in started.actions if isinstance(a, CreateAttempt)]
    assert create.world_size == 3, "no resharding: the spare holds the lost rank"
    assert create.carried == ("a1-0", "a1-2", "job-a1-s0")


def test_spares_are_made_once_every_rank_runs_and_replaced_when_lost() -> None:
    job = in_place(spares=1)
    plan = decide(observe(RUNNING, ranks(3), nodes(4), job=job))
    (made,) = [a for a in plan.actions if isinstance(a, CreateSpares)]
    assert made.names == ("job-a1-s0",)
    assert made.peers == ("a1-0", "a1-1", "a1-2")
    assert isinstance(plan.actions[0], PatchStatus), "a stale view makes no spare"

    starting = [*ranks(2), PodView("a1-2", 1, 2, "Pending", None)]
    assert not [
        a
        for a in decide(observe(RUNNING, starting, nodes(4), job=job)).actions
        if isinstance(a, CreateSpares)
    ]

    lost = [NodeView(n, n != "n3") for n in ("n0", "n1", "n2", "n3")]
    replaced = decide(observe(RUNNING, [*ranks(3), spare("job-a1-s0", "n3")], lost, job=job))
    assert [(d.names, d.force) for d in replaced.actions if isinstance(d, DeletePods)] == [
        (("job-a1-s0",), True)
    ]
    (again,) = [a for a in replaced.actions if isinstance(a, CreateSpares)]
    assert again.names == ("job-a1-s1",), "a new name while the lost one goes"

    fewer = decide(
        observe(RUNNING, [*ranks(3), spare("job-a1-s0", "n3")], nodes(4), job=in_place())
    )
    assert ("job-a1-s0",) in [d.names for d in fewer.actions if isinstance(d, DeletePods)]


def test_a_finished_job_keeps_no_spare_and_spares_need_in_place() -> None:
    done = JobState(phase="Succeeded", attempt=1, world_size=3)
    plan = decide(
        observe(
            done,
            [*ranks(3, phase="Succeeded"), spare("job-a1-s0", "n3")],
            nodes(4),
            job=in_place(spares=1),
        )
    )
    assert ("job-a1-s0",) in [d.names for d in plan.actions if isinstance(d, DeletePods)]
    with pytest.raises(SpecError, match="spec.spares=1 needs in-place restart"):
        spec(spares=1)


def test_a_spare_runs_the_launcher_idle_and_becomes_a_rank_by_its_labels() -> None:
    pod = builders.build_spare(BODY, in_place(), uri="u", name="demo-a1-s0", peers=["demo-a1-0"])
    labels = pod["metadata"]["labels"]
    assert (
        labels[LABEL_SPARE] == "true" and LABEL_ATTEMPT not in labels and LABEL_RANK not in labels
    )
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["CTJ_STANDBY"] == "1" and env["CTJ_ATTEMPT"] == "0" and "RANK" not in env
    assert pod["spec"]["containers"][0]["command"][:3] == ["python", "-m", LAUNCHER_MODULE]
    target = Target(body=BODY, spec=in_place(spares=1), uri="s3://b/p")
    (patch,) = [
        c for c in render(CreateAttempt(2, 1, (), ("demo-a1-s0",)), target) if c.kind == Kind.POD
    ]
    assert patch.body["metadata"]["labels"][LABEL_SPARE] is None, "no longer a spare"


def test_a_spare_kept_off_a_node_trusted_again_is_made_anew() -> None:
    waiting = PodView("job-a1-s0", 0, 0, "Pending", None, spare=True, avoid=("n3",))
    plan = decide(observe(RUNNING, [*ranks(3), waiting], nodes(4), job=in_place(spares=1)))
    assert ("job-a1-s0",) in [d.names for d in plan.actions if isinstance(d, DeletePods)]
    (again,) = [a for a in plan.actions if isinstance(a, CreateSpares)]
    assert again.names == ("job-a1-s1",) and again.avoid == ()
    suspect = dataclasses.replace(RUNNING, suspect={"n3": 1.0})
    kept = decide(observe(suspect, [*ranks(3), waiting], nodes(4), job=in_place(spares=1)))
    assert not [d for d in kept.actions if isinstance(d, DeletePods | CreateSpares)]


def test_after_a_spec_edit_no_pod_is_kept_so_every_pod_runs_the_new_spec() -> None:
    made_at_1 = dataclasses.replace(RUNNING, attempt_generation=1)
    the_nodes = [NodeView(n, n != "n1") for n in ("n0", "n1", "n2")]
    edited = dataclasses.replace(
        observe(made_at_1, ranks(3), the_nodes, job=in_place()), generation=2
    )
    assert decide(edited).status()["survivors"] is None
    unedited = dataclasses.replace(edited, generation=1)
    assert decide(unedited).status()["survivors"] == ["a1-0", "a1-2"]

    waiting = JobState(
        phase="Restarting", attempt=1, world_size=3, survivors=("a1-0", "a1-2"),
        attempt_generation=1,
    )  # fmt: skip
    kept = [ranks(3)[0], ranks(3)[2], spare("job-a1-s0", "n3")]
    later = dataclasses.replace(
        observe(waiting, kept, nodes(4), job=in_place(spares=1)), generation=2
    )
    plan = decide(later)
    deleted = {n for d in plan.actions if isinstance(d, DeletePods) for n in d.names}
    assert deleted == {"a1-0", "a1-2"}, deleted
    assert not [a for a in plan.actions if isinstance(a, CreateAttempt)], "they must go first"
    gone = dataclasses.replace(later, pods=[spare("job-a1-s0", "n3")])
    start = decide(gone)
    (create,) = [a for a in start.actions if isinstance(a, CreateAttempt)]
    assert create.carried == (), "every pod made from the edited spec"
    assert ("job-a1-s0",) in [d.names for d in start.actions if isinstance(d, DeletePods)]
