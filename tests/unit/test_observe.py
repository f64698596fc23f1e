"""What the operator remembers of the watches between ticks (observe.py)."""

from __future__ import annotations

import time

from ctj_operator.observe import (
    EXIT_MESSAGE_CHARS,
    Freshness,
    container_exit,
    node_rank,
    pod_summary,
    pod_view,
)


def test_freshness_counts_from_the_last_change_and_forgets_what_is_deleted() -> None:
    f = Freshness()
    f.see("lease", None)  # no renewTime yet: nothing to count from
    assert f.silent_for("lease") is None and len(f) == 0
    f.see("lease", "t1")
    first = f.changed_at("lease")
    time.sleep(0.01)
    f.see("lease", "t1")  # the same value again is not a beat
    assert f.changed_at("lease") == first
    silent = f.silent_for("lease")
    assert silent is not None and silent >= 0.01
    f.see("lease", "t2")
    renewed = f.silent_for("lease")
    assert renewed is not None and renewed < silent
    f.drop("lease")
    f.drop("never seen")
    assert f.silent_for("lease") is None and len(f) == 0


def test_a_rank_is_read_from_our_label_or_from_the_kubeflow_controllers() -> None:
    assert node_rank({"training.ctj.dev/node-rank": "2"}) == 2
    kf = "training.kubeflow.org/replica-"
    assert node_rank({f"{kf}type": "master", f"{kf}index": "0"}) == 0
    assert node_rank({f"{kf}type": "worker", f"{kf}index": "0"}) == 1
    assert node_rank({f"{kf}type": "worker", f"{kf}index": "4"}) == 5


def _failed_pod(message: str, code: int = 1, reason: str = "Error") -> dict[str, object]:
    terminated = {"exitCode": code, "reason": reason, "message": message}
    return {
        "metadata": {"name": "demo-a1-0", "labels": {"training.ctj.dev/node-rank": "0"}},
        "spec": {"nodeName": "n0"},
        "status": {
            "phase": "Failed",
            "initContainerStatuses": [  # our sidecar, stopped with the pod: not the cause
                {"name": "ctj-sidecar", "state": {"terminated": {"exitCode": 143}}}
            ],
            "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}],
        },
    }


def test_a_failed_trainer_says_why_in_its_last_line() -> None:
    log = (
        "step 1\nTraceback (most recent call last):\n  ...\n"
        "ResumeSourceError: spec.checkpoint.resumeFrom 'train' names no checkpoint\n\n"
    )
    summary = pod_summary(_failed_pod(log))
    assert summary["exit"] == (
        "trainer exited 1: ResumeSourceError: spec.checkpoint.resumeFrom 'train' names no "
        "checkpoint"
    )
    assert pod_view(summary).exit == summary["exit"]
    assert container_exit(_failed_pod("", 137, "OOMKilled")["status"]) == (  # type: ignore[arg-type]
        "trainer exited 137 (OOMKilled)"
    )
    long = container_exit(_failed_pod("x" * 1000)["status"])  # type: ignore[arg-type]
    assert len(long) < EXIT_MESSAGE_CHARS + 30 and long.endswith("...")


def test_a_trainer_that_exited_0_or_runs_has_no_exit_reason() -> None:
    done = _failed_pod("all good", code=0)
    assert pod_summary(done)["exit"] == ""
    running = {"containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}
    assert container_exit(running) == ""
    # a summary indexed by an operator before this field: no exit reason, no KeyError
    old = {k: v for k, v in pod_summary(done).items() if k != "exit"}
    assert pod_view(old).exit == ""


def test_a_pod_whose_trainer_ended_is_finished_while_its_sidecar_stops() -> None:
    """The pod still reads Running while the kubelet stops its native sidecar; its
    heartbeat stops with the sidecar, so the decisions must know the trainer is done."""
    done = _failed_pod("all good", code=0)
    done["status"]["phase"] = "Running"  # type: ignore[index]
    assert pod_summary(done)["finished"] and pod_view(pod_summary(done)).finished
    running = {**done, "status": {"phase": "Running", "containerStatuses": [
        {"name": "trainer", "state": {"running": {}}}]}}  # fmt: skip
    assert not pod_summary(running)["finished"]
    starting = {**done, "status": {"phase": "Pending"}}
    assert not pod_summary(starting)["finished"]
    old = {k: v for k, v in pod_summary(done).items() if k != "finished"}
    assert not pod_view(old).finished
