"""Saves faster than uploads: the busy policy holds and host memory stays at one staged copy."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.conftest import promtool_check
from tests.integration.test_sidecar import wait_until
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.store import repository as repo

pytestmark = pytest.mark.integration
MIB = 1 << 20


def model_of(mib: int) -> torch.nn.Module:
    torch.manual_seed(0)
    n = mib * MIB // 4 // 1024
    return torch.nn.Sequential(
        torch.nn.Linear(1024, n // 2, bias=False), torch.nn.Linear(n // 2, 1024, bias=False)
    )


def state_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def staged_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.distcp"))


def rss_bytes() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def slow_config(uri: str, policy: str) -> CheckpointConfig:
    """One 1 MiB chunk at a time: an upload takes far longer than staging."""
    return CheckpointConfig(
        uri=uri, busy_policy=policy, mode="full", keep_last=0, parallelism=1, chunk_size=MIB
    )


def test_skip_policy_skips_counts_and_keeps_one_copy(s3_uri: str) -> None:
    model = model_of(32)
    ckpt = Checkpointer(slow_config(s3_uri, "skip"))
    outcomes, peak = {}, 0
    for step in range(1, 11):
        with torch.no_grad():
            model[0].weight.add_(1)
        outcomes[step] = ckpt.save(step, model=model)
        peak = max(peak, staged_bytes(ckpt.root))
    ckpt.close()
    skipped = [s for s, p in outcomes.items() if p is None]
    assert skipped, "saves back to back should outrun a 32 MiB upload"
    assert ckpt.metrics.registry.get_sample_value("ctj_checkpoint_skipped_total") == len(skipped)
    assert repo.committed_steps(ckpt.store) == [s for s, p in outcomes.items() if p is not None]
    assert peak <= 1.1 * state_bytes(model)


def test_wait_policy_commits_every_save_with_bounded_memory(s3_uri: str) -> None:
    model = model_of(64)
    size = state_bytes(model)
    ckpt = Checkpointer(slow_config(s3_uri, "wait"))
    ckpt.save(0, model=model).result()  # the slot's pages are now touched
    base, peak_rss, peak_staged = rss_bytes(), 0, 0
    pendings = []
    for step in range(1, 6):
        with torch.no_grad():
            model[1].weight.add_(1)
        pendings.append(ckpt.save(step, model=model))
        peak_rss = max(peak_rss, rss_bytes())
        peak_staged = max(peak_staged, staged_bytes(ckpt.root))
    assert [p.result().step for p in pendings] == [1, 2, 3, 4, 5]
    ckpt.close()
    assert repo.committed_steps(ckpt.store) == [0, 1, 2, 3, 4, 5]
    assert peak_staged <= 1.1 * size
    # one staged copy already counted in base; upload buffers are a few chunks at most
    assert peak_rss - base <= 0.1 * size + 32 * MIB, (peak_rss - base) / MIB


def test_in_process_metrics_after_save_and_restore_pass_promtool(s3_uri: str) -> None:
    config = CheckpointConfig(uri=s3_uri, metrics_port=0)
    ckpt = Checkpointer(config)
    ckpt.save(1, model=torch.nn.Linear(16, 16)).result()
    assert ckpt.load(model=torch.nn.Linear(16, 16)) is not None

    def scrape() -> str:
        url = f"http://127.0.0.1:{ckpt.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()

    wait_until(lambda: "ctj_checkpoint_commit_seconds_count 1.0" in scrape(), "commit metric")
    text = scrape()
    for series in (
        'ctj_checkpoint_stall_seconds_count{rank="0"} 1.0',
        'ctj_checkpoint_upload_seconds_count{rank="0"} 1.0',
        'ctj_checkpoint_restore_seconds_count{rank="0"} 1.0',
        'ctj_checkpoint_bytes_total{kind="logical"}',
        'ctj_checkpoint_bytes_total{kind="deduplicated"}',
        'ctj_checkpoint_failures_total{stage="restore"} 0.0',
        "ctj_checkpoint_last_success_timestamp_seconds",
    ):
        assert series in text, series
    check = promtool_check(text)
    assert check.returncode == 0, check.stdout + check.stderr
    ckpt.close()
