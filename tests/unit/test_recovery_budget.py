"""The recovery budget's arithmetic (ctj_stack.budget), which the e2e tier and the
recovery benchmark print for every recovery."""

from __future__ import annotations

from ctj_stack.budget import PHASES, format_budget, recovery_budget

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
