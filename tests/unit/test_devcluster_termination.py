"""The simulated kubelet keeps a failed container's termination message as the kubelet
does under terminationMessagePolicy FallbackToLogsOnError: the end of its log."""

from __future__ import annotations

from pathlib import Path

from ctj_devcluster.pod_worker import TERMINATION_LOG_BYTES, TERMINATION_LOG_LINES, log_tail


def test_the_message_is_the_last_lines_within_the_byte_limit(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text("".join(f"line {i}\n" for i in range(200)))
    lines = log_tail(log).splitlines()
    assert len(lines) == TERMINATION_LOG_LINES and lines[-1] == "line 199"
    log.write_text("x" * 5000 + "\nthe reason\n")
    tail = log_tail(log)
    assert tail.endswith("the reason") and len(tail.encode()) <= TERMINATION_LOG_BYTES


def test_no_log_is_no_message(tmp_path: Path) -> None:
    assert log_tail(tmp_path / "absent.log") == ""
