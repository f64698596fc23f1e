"""What the metrics modules export beyond plain counters: per-job series of the operator
(set at each reconcile, removed with the job), the checkpoint cadence, the staging room."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from ctj_operator.decisions import PatchStatus
from ctj_operator.metrics import OperatorMetrics, checkpoint_interval, reported_checkpoint
from prometheus_client import CollectorRegistry, generate_latest

from trainer_sidecar.metrics import CheckpointMetrics, StagingCollector, main, serve, wait_ready

ROOT = Path(__file__).resolve().parents[2]


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    value = registry.get_sample_value(name, labels)
    return None if value is None else float(value)


def test_a_reconcile_exports_the_jobs_series_and_a_deletion_removes_them() -> None:
    m = OperatorMetrics()
    m.job_seen("ml", "a", "Running", 3, 2)
    m.job_seen("ml", "b", "Restarting", 0, 0)  # between attempts: no world size to show
    r = m.registry
    assert sample(r, "ctj_job_attempt", namespace="ml", job_name="a") == 2
    assert sample(r, "ctj_job_world_size", namespace="ml", job_name="a") == 3
    assert sample(r, "ctj_job_attempt", namespace="ml", job_name="b") is None
    assert sample(r, "ctj_jobs", phase="Running") == 1 == sample(r, "ctj_jobs", phase="Restarting")
    m.job_phase("ml", "a", None)
    assert sample(r, "ctj_job_attempt", namespace="ml", job_name="a") is None
    assert sample(r, "ctj_job_world_size", namespace="ml", job_name="a") is None
    assert sample(r, "ctj_jobs", phase="Running") == 0


def test_a_jobs_phase_is_one_series_that_moves_with_the_phase() -> None:
    m = OperatorMetrics()
    r = m.registry
    m.job_seen("ml", "a", "Pending", 0, 0)
    assert sample(r, "ctj_job_phase", namespace="ml", job_name="a", phase="Pending") == 1
    m.record("ml", "a", PatchStatus({"phase": "Running"}))
    assert sample(r, "ctj_job_phase", namespace="ml", job_name="a", phase="Running") == 1
    assert sample(r, "ctj_job_phase", namespace="ml", job_name="a", phase="Pending") is None
    m.record("ml", "a", PatchStatus({"phase": "Failed"}))
    phases = [s for s in _samples(r, "ctj_job_phase") if s.labels["job_name"] == "a"]
    assert [s.labels["phase"] for s in phases] == ["Failed"]
    m.job_phase("ml", "a", None)
    assert _samples(r, "ctj_job_phase") == []


def _samples(registry: CollectorRegistry, name: str) -> list:  # type: ignore[type-arg]
    return [s for f in registry.collect() for s in f.samples if s.name == name]


LAST = {"step": 100, "time": "2026-01-01T00:00:00Z", "bytes": 10}
NEXT = {"step": 200, "time": "2026-01-01T00:05:00Z", "bytes": 10}


def test_the_last_checkpoint_and_its_cadence_per_job_outlive_the_attempts() -> None:
    """From status.lastCheckpoint: a restarted operator exports it at its first reconcile
    (job_seen), the interval once it has seen a second commit, whatever the attempt."""
    m = OperatorMetrics()
    r = m.registry
    labels = {"namespace": "ml", "job_name": "a"}
    m.job_seen("ml", "a", "Running", 3, 1, LAST)
    t0 = reported_checkpoint(LAST)
    assert t0 is not None
    assert sample(r, "ctj_job_last_checkpoint_timestamp_seconds", **labels) == t0[1]
    assert sample(r, "ctj_job_last_checkpoint_step", **labels) == 100
    assert sample(r, "ctj_job_checkpoint_interval_seconds", **labels) is None
    m.job_seen("ml", "a", "Running", 3, 1, LAST)  # every reconcile: nothing new
    assert sample(r, "ctj_job_checkpoint_interval_seconds", **labels) is None
    m.record("ml", "a", PatchStatus({"attempt": 2, "lastCheckpoint": NEXT}))  # a new attempt
    assert sample(r, "ctj_job_checkpoint_interval_seconds", **labels) == 300
    assert sample(r, "ctj_job_last_checkpoint_step", **labels) == 200
    m.job_seen("ml", "a", "Running", 2, 2, LAST)  # a stale read of the job: kept the newer
    assert sample(r, "ctj_job_last_checkpoint_step", **labels) == 200
    m.job_phase("ml", "a", None)
    for name in ("timestamp_seconds", "step"):
        assert sample(r, f"ctj_job_last_checkpoint_{name}", **labels) is None
    assert sample(r, "ctj_job_checkpoint_interval_seconds", **labels) is None


@pytest.mark.parametrize(
    ("previous", "current", "expected"),
    [
        (None, (1, 100.0), None),  # the first seen
        ((1, 100.0), (1, 100.0), None),  # the same again
        ((1, 100.0), (2, 100.0), None),  # within the same second
        ((2, 200.0), (1, 100.0), None),  # an older one
        ((1, 100.0), (2, 160.0), 60.0),
    ],
)
def test_checkpoint_interval(
    previous: tuple[int, float] | None, current: tuple[int, float], expected: float | None
) -> None:
    assert checkpoint_interval(previous, current) == expected


@pytest.mark.parametrize(
    "value",
    [None, {}, {"step": 1}, {"step": "x", "time": LAST["time"]}, {"step": 1, "time": "soon"}],
)
def test_an_unreadable_last_checkpoint_is_ignored(value: dict | None) -> None:  # type: ignore[type-arg]
    assert reported_checkpoint(value) is None
    m = OperatorMetrics()
    m.job_seen("ml", "a", "Running", 1, 1, value)
    assert _samples(m.registry, "ctj_job_last_checkpoint_step") == []


def test_build_info_names_the_project_version_in_the_operator_and_the_checkpoint_engine() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    operator = OperatorMetrics().registry
    engine = CheckpointMetrics().registry
    assert sample(operator, "ctj_build_info", version=version, component="operator") == 1
    assert sample(engine, "ctj_build_info", version=version, component="checkpoint") == 1
    assert len(_samples(operator, "ctj_build_info")) == len(_samples(engine, "ctj_build_info")) == 1


def test_wait_ready_asks_again_while_not_ready_and_while_refused() -> None:
    """The sidecar's startup probe: a 503 (not ready yet) and a refused connection (not
    listening yet) are asked again until the timeout; the first 200 ends the wait."""
    asked: list[int] = []

    def ready() -> bool:  # ready at the third ask
        asked.append(1)
        return len(asked) >= 3

    server = serve(0, CheckpointMetrics(), ready=ready, host="127.0.0.1")
    port = server.server_address[1]
    try:
        assert wait_ready(f"http://127.0.0.1:{port}/readyz", 30, poll_s=0.01)
        assert len(asked) == 3
        args = ["wait-ready", "--host", "127.0.0.1", "--port", str(port), "--timeout", "5"]
        assert main(args) == 0
        never = serve(0, CheckpointMetrics(), ready=lambda: False, host="127.0.0.1")
        try:
            assert not wait_ready(f"http://127.0.0.1:{never.server_address[1]}/readyz", 0.3)
        finally:
            never.shutdown()
            never.server_close()
    finally:
        server.shutdown()
        server.server_close()
    # nothing listens there any more: refused until the timeout, then exit 1
    args = ["wait-ready", "--host", "127.0.0.1", "--port", str(port), "--timeout", "0.3"]
    assert main(args) == 1


def test_the_interval_is_the_time_between_the_last_two_commits(tmp_path: Path) -> None:
    import torch

    from trainer_sidecar import CheckpointConfig, Checkpointer

    config = CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(tmp_path / "s"))
    model = torch.nn.Linear(4, 4)
    with Checkpointer(config) as ckpt:
        ckpt.save(1, model=model).result()  # type: ignore[union-attr]
        persister = ckpt._persister
        assert persister is not None
        first = persister.latest_committed()
        assert sample(ckpt.metrics.registry, "ctj_checkpoint_interval_seconds") == 0
        ckpt.save(2, model=model).result()  # type: ignore[union-attr]
        second = persister.latest_committed()
    assert first is not None and second is not None and second.step == 2
    interval = sample(ckpt.metrics.registry, "ctj_checkpoint_interval_seconds")
    assert interval == second.created - first.created and interval > 0


def test_the_staging_room_is_read_at_each_scrape(tmp_path: Path) -> None:
    registry = CheckpointMetrics().registry
    registry.register(StagingCollector(tmp_path))
    fs = os.statvfs(tmp_path)
    assert sample(registry, "ctj_staging_capacity_bytes") == fs.f_blocks * fs.f_frsize
    used = sample(registry, "ctj_staging_used_bytes")
    assert used is not None and 0 < used <= fs.f_blocks * fs.f_frsize
    gone = CollectorRegistry()
    gone.register(StagingCollector(tmp_path / "missing"))
    assert b"ctj_staging" not in generate_latest(gone)  # no volume (yet): no series
