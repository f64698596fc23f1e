"""The recovery budget: where the time from a failure to the first step after it went.

From three clocks that agree (one machine, or NTP): the moment the harness caused the
failure (``failed_at``), the operator's ``status.lastRecovery`` (when it saw the failure,
started the next attempt, saw every rank Running) and rank 0's ``restored`` event of the
next attempt (examples/train_fsdp.py: when its Python started, its imports ended, the
rendezvous ended, how long the restore took) and its first step after it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

PHASES = (
    ("detect_s", "the failure seen by the operator"),
    ("teardown_s", "the old attempt torn down, the backoff waited, the next one started"),
    ("pod_start_s", "the new pods scheduled, their containers started, the worker's Python up"),
    ("imports_s", "the worker's imports (torch)"),
    ("rendezvous_s", "every rank of the attempt met (init_process_group)"),
    ("prepare_s", "the model built, the Checkpointer made, the restore planned"),
    ("restore_s", "the checkpoint read into the model"),
    ("first_step_s", "the first training step after it"),
)


def recovery_budget(
    failed_at: float,
    recovery: Mapping[str, Any],
    restored: Mapping[str, Any],
    first_step: Mapping[str, Any],
) -> dict[str, float | None]:
    """Seconds per phase (PHASES) and ``total_s``, failure to first step; a phase whose
    marks are missing (an older trainer, a status without lastRecovery) is None."""

    def span(end: Any, start: Any) -> float | None:
        return None if end is None or start is None else round(float(end) - float(start), 2)

    restore_began = None
    if restored.get("t") is not None and restored.get("seconds") is not None:
        restore_began = float(restored["t"]) - float(restored["seconds"])
    seen, started = recovery.get("failureSeenAt"), recovery.get("attemptStarted")
    return {
        "detect_s": span(seen, failed_at),
        "teardown_s": span(started, seen),
        "pod_start_s": span(restored.get("started"), started),
        "imports_s": span(restored.get("imported"), restored.get("started")),
        "rendezvous_s": span(restored.get("rendezvous"), restored.get("imported")),
        "prepare_s": span(restore_began, restored.get("rendezvous")),
        "restore_s": span(restored.get("seconds"), 0.0),
        "first_step_s": span(first_step.get("t"), restored.get("t")),
        "total_s": span(first_step.get("t"), failed_at),
    }


def format_budget(budget: Mapping[str, float | None]) -> str:
    """One line: ``detect 2.8 s, teardown 1.1 s, ... = 12.3 s``."""
    parts = [
        f"{name.removesuffix('_s').replace('_', ' ')} "
        + ("?" if budget.get(name) is None else f"{budget[name]:.1f} s")
        for name, _ in PHASES
    ]
    total = budget.get("total_s")
    return ", ".join(parts) + (f" = {total:.1f} s" if total is not None else "")


def summarize(budgets: Sequence[Mapping[str, float | None]]) -> dict[str, dict[str, float]]:
    """Per phase (and ``total_s``) over several recoveries: median, min, max and the count
    of rounds that measured it (phases no round measured are left out)."""
    out: dict[str, dict[str, float]] = {}
    for name in [*(n for n, _ in PHASES), "total_s"]:
        values = [float(v) for b in budgets if (v := b.get(name)) is not None]
        if values:
            out[name] = {
                "median": round(statistics.median(values), 2),
                "min": min(values),
                "max": max(values),
                "rounds": len(values),
            }
    return out


def format_summary(summary: Mapping[str, Mapping[str, float]]) -> str:
    """A table: phase, median, min-max, rounds."""
    rows = [f"{'phase':<14}{'median':>8}  {'min-max':>13}  rounds"]
    for name, s in summary.items():
        spread = f"{s['min']:.1f}-{s['max']:.1f}"
        rows.append(f"{name.removesuffix('_s'):<14}{s['median']:>7.1f}s  {spread:>12}s  "
                    f"{int(s['rounds'])}")  # fmt: skip
    return "\n".join(rows)
