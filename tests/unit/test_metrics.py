"""What the metrics modules export beyond plain counters: per-job series of the operator
(set at each reconcile, removed with the job), the checkpoint cadence, the staging room."""

from __future__ import annotations

import os
from pathlib import Path

from ctj_operator.metrics import OperatorMetrics
from prometheus_client import CollectorRegistry, generate_latest

from trainer_sidecar.metrics import CheckpointMetrics, StagingCollector


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
