"""The recovery budget's arithmetic (ctj_stack.budget), which the e2e tier and the
recovery benchmark print for every recovery."""

from __future__ import annotations

from ctj_stack.budget import PHASES, format_budget, format_summary, recovery_budget, summarize

RECOVERY = {"reason": "HeartbeatLost", "failureSeenAt": 103.0, "attemptStarted": 104.5,
            "runningAt": 107.0, "seconds": 4.0}  # fmt: skip
RESTORED = {"t": 112.25, "seconds": 0.5, "started": 106.0, "imported": 109.0, "rendezvous": 111.0}
FIRST = {"t": 113.0}


def test_the_phases_add_up_to_the_total() -> None:
    budget = recovery_budget(100.0, RECOVERY, RESTORED, FIRST)
    assert budget == {
        "detect_s": 3.0,
        "teardown_s": 1.5,
        "pod_start_s": 1.5,
        "imports_s": 3.0,
        "rendezvous_s": 2.0,
        "prepare_s": 0.75,
        "restore_s": 0.5,
        "first_step_s": 0.75,
        "total_s": 13.0,
    }
    assert sum(v for k, v in budget.items() if k != "total_s" and v) == budget["total_s"]
    assert [name for name, _ in PHASES] == [k for k in budget if k != "total_s"]


def test_missing_marks_leave_their_phases_unknown() -> None:
    """A trainer that logs no start marks: only what the status and the events give."""
    budget = recovery_budget(100.0, {}, {"t": 112.25, "seconds": 0.5}, FIRST)
    assert budget["detect_s"] is None and budget["imports_s"] is None
    assert (budget["restore_s"], budget["total_s"]) == (0.5, 13.0)
    line = format_budget(budget)
    assert line.startswith("detect ?, teardown ?,") and line.endswith("= 13.0 s"), line


def test_rounds_summarize_to_medians_and_spreads() -> None:
    fast = recovery_budget(100.0, RECOVERY, RESTORED, FIRST)
    slow = {**fast, "detect_s": 5.0, "total_s": 15.0}
    unknown = {**fast, "detect_s": None, "total_s": 14.0}
    summary = summarize([fast, slow, unknown])
    assert summary["detect_s"] == {"median": 4.0, "min": 3.0, "max": 5.0, "rounds": 2}
    assert summary["total_s"] == {"median": 14.0, "min": 13.0, "max": 15.0, "rounds": 3}
    table = format_summary(summary)
    assert table.splitlines()[0].split() == ["phase", "median", "min-max", "rounds"]
    assert "detect" in table and "3.0-5.0s" in table
    assert summarize([]) == {}
