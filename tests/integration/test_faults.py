"""Faults: corrupt chunks, a saver killed mid-upload. Nothing half-written is ever loaded."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import torch

from tests.conftest import ROOT
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.format.manifest import MANIFESTS
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.base import Location

pytestmark = pytest.mark.integration


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))


def ctj(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer_sidecar", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def flip_one_byte(uri: str, endpoint: str, key: str) -> None:
    loc = Location.parse(uri)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    full = f"{loc.prefix}/{key}"
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=full)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=loc.bucket, Key=full, Body=bytes(body))


def test_corrupt_chunk_is_named_by_verify_and_load_falls_back(
    s3_uri: str, s3_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    config = CheckpointConfig(uri=s3_uri, mode="incremental")
    ckpt = Checkpointer(config)
    model = small_model(0)
    ckpt.save(1, model=model).result()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[1].weight.mul_(2)
    ckpt.save(2, model=model).result()
    keys = {step: repo.read_manifest(ckpt.store, step).chunk_keys() for step in (1, 2)}
    only_in_2 = sorted(keys[2] - keys[1])
    flip_one_byte(s3_uri, s3_env["AWS_ENDPOINT_URL"], only_in_2[0])
    bad_id = only_in_2[0].rsplit("/", 1)[-1]

    out = ctj("checkpoints", "verify", s3_uri, "--all")
    assert out.returncode == 1, out.stderr
    assert f"step 2: CORRUPT: fails its hash check: chunk {bad_id}" in out.stdout
    assert "step 1: ok" in out.stdout

    fresh = small_model(7)
    with caplog.at_level(logging.WARNING, logger="ctj.checkpoint"):
        loaded = Checkpointer(config).load(model=fresh)
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (2,)
    assert any("step 2 is unusable" in r.message and bad_id in r.message for r in caplog.records)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())


def test_kill_9_mid_upload_leaves_previous_checkpoint_and_gc_cleans(
    s3_uri: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    marker = tmp_path / "hung"
    args = {"uri": s3_uri, "ref": str(tmp_path / "ref.pt"), "marker": str(marker)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.ranks",
            "tests.integration.workers:save_then_die_mid_upload",
            json.dumps(args),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, "the saver exited before hanging"
        assert time.monotonic() < deadline, "the saver never reached its upload"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)

    store = Checkpointer(CheckpointConfig(uri=s3_uri)).store
    assert repo.committed_steps(store) == [1]
    committed = repo.read_manifest(store, 1).chunk_keys()
    orphans = {o.key for o in store.list("chunks/")} - committed
    assert orphans, "the killed save uploaded nothing: the test did not interrupt an upload"

    fresh = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    loaded = Checkpointer(CheckpointConfig(uri=s3_uri)).load(model=fresh)
    assert loaded is not None and loaded.step == 1
    want = torch.load(args["ref"], weights_only=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())

    report = repo.collect_garbage(store, grace_s=0)
    assert report.deleted_chunks == len(orphans)
    assert {o.key for o in store.list("chunks/")} == committed
    assert [o.key for o in store.list(MANIFESTS)] == ["manifests/" + f"{1:020d}.json"]
