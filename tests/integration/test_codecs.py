"""Compression changed between saves and between runs: dedup names only objects that exist.

Chunks are stored per codec (``<id>`` or ``<id>.zst``); a delta names a chunk its
reference holds exactly as the reference stored it. After zstd <-> none switches
and a gc with no grace, every checkpoint verifies and restores bitwise.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_deltas import change_tenth, make_model, snapshot
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.format.manifest import Codec
from trainer_sidecar.load.verify import verify
from trainer_sidecar.store import repository as repo

pytestmark = pytest.mark.integration


def test_switching_compression_between_saves_and_runs_keeps_every_checkpoint_whole(
    s3_uri: str, s3_env: dict[str, str]
) -> None:
    model = make_model(0)
    want: dict[int, dict[str, torch.Tensor]] = {}
    step = 0
    # three runs (a new Checkpointer each, as a restarted job), alternating the codec;
    # within the second run the codec also changes between two saves
    for run, codecs in enumerate(([Codec.NONE] * 2, [Codec.ZSTD, Codec.NONE], [Codec.ZSTD] * 2)):
        for codec in codecs:
            step += 1
            config = CheckpointConfig(
                uri=s3_uri, mode="incremental", keep_last=0, compression=codec, gc_grace_s=0
            )
            with Checkpointer(config) as ckpt:
                change_tenth(model, step)
                pending = ckpt.save(step, model=model)
                assert pending is not None
                want[step] = snapshot(model)
                result = pending.result()
                # 90% of the state was deduplicated against the previous step, whatever
                # codec that one used
                if step > 1:
                    assert result.deduplicated_bytes > 0.8 * result.logical_bytes, (run, result)
    ckpt = Checkpointer(CheckpointConfig(uri=s3_uri))
    store = ckpt.store
    listed = {o.key: o.size for o in store.list("chunks/")}
    for s in repo.committed_steps(store):
        manifest = repo.read_manifest(store, s)
        for key, chunk in manifest.chunks().items():
            assert key in listed, f"step {s} names {key}, which is not stored"
            assert listed[key] == chunk.stored_size, (s, key)  # stored sizes recorded exactly
    codecs_named = {c.codec for s in want for c in repo.read_manifest(store, s).chunks().values()}
    assert codecs_named == {"none", "zstd"}
    repo.collect_garbage(store, grace_s=0)
    for s, state in want.items():
        assert not verify(store, repo.read_manifest(store, s)), s
        fresh = make_model(99)
        loaded = ckpt.load(model=fresh, step=s)
        assert loaded is not None and loaded.step == s
        got = fresh.state_dict()
        assert all(torch.equal(got[k], v) for k, v in state.items()), s
