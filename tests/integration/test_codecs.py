"""Compression changed between saves and between runs: dedup names only objects that exist.

Chunks are stored per codec (``<id>``, ``<id>.zst``, ``<id>.bp4.zst``, ...); a delta names
a chunk its reference holds exactly as the reference stored it. After none <-> zstd <->
auto (byte planes) switches and a gc with no grace, every checkpoint verifies and
restores bitwise; with retention, every kept one does, even where one chunk id is
stored under several codecs and only some of those objects are still named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.ranks import run_ranks
from tests.integration.test_cli import ctj
from tests.integration.test_deltas import change_tenth, make_model, snapshot
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.format.codecs import Compression
from trainer_sidecar.format.manifest import Mode
from trainer_sidecar.load.verify import verify
from trainer_sidecar.store import repository as repo

pytestmark = pytest.mark.integration

NONE, ZSTD, AUTO = Compression.NONE, Compression.ZSTD, Compression.AUTO


def save_runs(
    s3_uri: str, runs: tuple[list[Compression], ...], **config: Any
) -> dict[int, dict[str, torch.Tensor]]:
    """One Checkpointer per run (as a restarted job), one save per listed compression, a
    tenth of the model changed before each; the state each step saved."""
    model = make_model(0)
    want: dict[int, dict[str, torch.Tensor]] = {}
    step = 0
    for run, compressions in enumerate(runs):
        for compression in compressions:
            step += 1
            cfg = CheckpointConfig(
                uri=s3_uri, mode=Mode.INCREMENTAL, compression=compression, gc_grace_s=0, **config
            )
            with Checkpointer(cfg) as ckpt:
                change_tenth(model, step)
                pending = ckpt.save(step, model=model)
                assert pending is not None
                want[step] = snapshot(model)
                result = pending.result()
                # a delta deduplicates 90% of the state against the previous step, whatever
                # codec that one used
                if result.mode != "full":
                    assert result.deduplicated_bytes > 0.8 * result.logical_bytes, (run, result)
    return want


def check_stored_and_restore(s3_uri: str, want: dict[int, dict[str, torch.Tensor]]) -> set[str]:
    """Every committed checkpoint names only stored objects, at their stored sizes, and
    verifies and restores bitwise; returns the codecs they name."""
    ckpt = Checkpointer(CheckpointConfig(uri=s3_uri))
    store = ckpt.store
    listed = {o.key: o.size for o in store.list("chunks/")}
    named: set[str] = set()
    steps = repo.committed_steps(store)
    assert set(steps) == set(want)
    for s in steps:
        manifest = repo.read_manifest(store, s)
        for key, chunk in manifest.chunks().items():
            assert key in listed, f"step {s} names {key}, which is not stored"
            assert listed[key] == chunk.stored_size, (s, key)  # stored sizes recorded exactly
            named.add(chunk.codec)
        assert not verify(store, manifest), s
        fresh = make_model(99)
        loaded = ckpt.load(model=fresh, step=s)
        assert loaded is not None and loaded.step == s
        got = fresh.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want[s].items()), s
    return named


def test_switching_compression_between_saves_and_runs_keeps_every_checkpoint_whole(
    s3_uri: str, s3_env: dict[str, str]
) -> None:
    # three runs, alternating the codec; within the second run it also changes between saves
    runs = ([NONE] * 2, [ZSTD, AUTO, NONE], [ZSTD, AUTO])
    want = save_runs(s3_uri, runs, keep_last=0)
    store = Checkpointer(CheckpointConfig(uri=s3_uri)).store
    repo.collect_garbage(store, grace_s=0)
    named = check_stored_and_restore(s3_uri, want)
    # the 512x512 fp32 weights and the packs of fp32 biases go into byte planes under auto;
    # .metadata is plain zstd
    assert named == {"none", "zstd", "zstd-bp4"}
    out = ctj("checkpoints", "show", s3_uri)  # the latest (auto): what each codec stores
    assert out.returncode == 0, out.stderr
    stored = next(line for line in out.stdout.splitlines() if line.startswith("stored: "))
    assert "zstd-bp4 " in stored and "x)" in stored, stored


def test_retention_and_gc_after_codec_switches_keep_every_kept_checkpoint_whole(
    s3_uri: str, s3_env: dict[str, str]
) -> None:
    """Full saves re-store unchanged chunks under their own codec: one chunk id ends up as
    ``<id>``, ``<id>.bp4.zst`` and ``<id>.zst``. Retention (keep 3) with gc at zero grace
    after every commit deletes the objects only retired checkpoints named, never one a
    kept checkpoint names under another codec."""
    # every transition: none->zstd, zstd->auto, auto->none, none->auto, auto->zstd, zstd->none
    runs = ([NONE, ZSTD], [AUTO, AUTO], [NONE, AUTO, ZSTD, NONE])
    want = save_runs(s3_uri, runs, keep_last=3, full_every=3)  # full: steps 1, 4, 7
    store = Checkpointer(CheckpointConfig(uri=s3_uri)).store
    kept = repo.committed_steps(store)
    assert kept == [4, 6, 7, 8]  # the last 3, and step 6's base
    repo.collect_garbage(store, grace_s=0)
    ids: dict[str, set[str]] = {}
    for o in store.list("chunks/"):
        name = o.key.rsplit("/", 1)[-1]
        ids.setdefault(name[:64], set()).add(name[64:])
    assert any(len(suffixes) >= 2 for suffixes in ids.values()), ids  # one id, two codecs
    named = check_stored_and_restore(s3_uri, {s: want[s] for s in kept})
    assert {"none", "zstd", "zstd-bp4"} <= named
    # nothing is stored that no kept checkpoint names
    keys = set().union(*(repo.read_manifest(store, s).chunk_keys() for s in kept))
    assert {o.key for o in store.list("chunks/")} == keys


def test_byte_plane_checkpoint_loads_resharded_bitwise(s3_uri: str, tmp_path: Path) -> None:
    """Saved at 2 ranks with compression auto (fp32 and bf16 tensors cut into byte-plane
    chunks mid-tensor, packs, values), loaded at 1 rank: every tensor bitwise equal."""
    config = {"compression": "auto", "chunk_size": 16384, "block_size": 4096}
    args = {"kind": "wide", "uri": s3_uri, "step": 5, "ref": str(tmp_path / "ref.pt")}
    args["config"] = config
    run_ranks(2, "tests.integration.workers:save", args)
    store = Checkpointer(CheckpointConfig(uri=s3_uri)).store
    manifest = repo.read_manifest(store, 5)
    codecs = {c.codec for c in manifest.chunks().values()}
    assert {"zstd-bp4", "zstd-bp2", "zstd"} <= codecs, codecs
    outputs = run_ranks(1, "tests.integration.workers:load_and_compare", args)
    assert "bitwise equal:" in outputs[0] and "at world size 1" in outputs[0]
