"""gc never deletes what a committed checkpoint names, even when its delete arrives late.

The race, on a real S3 server: step 1 holds a tensor of zeros (chunk Z); steps 2 and 3
retire it; gc lists the store, finds Z old and unnamed, and sends its delete, which a proxy
holds in flight (as a slow or retried request can be). Meanwhile save 4 puts the zeros
back and stores Z again. Before the fence (store/gc_fence.py), save 4 committed at once
and the late delete then removed Z from under it: step 4 failed verify and a load fell
back to step 3. With it, save 4 waits for that gc run to finish, stores Z once more, and
every committed checkpoint verifies and loads.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable

import pytest
import torch

from tests.integration.s3_proxy import FaultProxy
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.config import Mode
from trainer_sidecar.format.manifest import manifest_key, retired_key
from trainer_sidecar.load.verify import verify
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.gc_fence import (
    MARKERS,
    Phase,
    marker_key,
    parse_keys,
    runs_in,
    store_now,
)
from trainer_sidecar.store.s3 import S3Settings, open_store

pytestmark = pytest.mark.integration
GRACE_S = 1.0


def wait_for(what: str, check: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def model_with(zeros: bool, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(64, 64))
    if zeros:
        with torch.no_grad():
            model[0].weight.zero_()  # type: ignore[operator]  # 4 MiB of zeros: the chunk gc retires and a save revives
    return model


def test_a_chunk_stored_again_while_gc_deletes_it_is_not_lost(
    s3_uri: str,
    s3_env: dict[str, str],
    s3_proxy: Callable[..., FaultProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_sidecar.store.gc_fence")
    config = CheckpointConfig(uri=s3_uri, mode=Mode.FULL, keep_last=1, gc_grace_s=3600)
    ckpt = Checkpointer(config)
    store = ckpt.store
    models = {1: model_with(True, 1), 2: model_with(False, 2), 3: model_with(False, 3)}
    for step, model in models.items():
        ckpt.save(step, model=model).result()  # type: ignore[union-attr]
    assert repo.committed_steps(store) == [3]  # 1 and 2 retired: their chunks unnamed
    step1 = repo.read_manifest(store, 1, retired_too=True)
    zeros_chunks = {c.key for f in step1.files.values() for c in f.chunks if c.size >= 1 << 20}
    step3 = repo.read_manifest(store, 3)
    assert not zeros_chunks & {c.key for f in step3.files.values() for c in f.chunks}
    assert zeros_chunks

    def old_enough() -> bool:  # on the store's clock, as gc measures
        now = store_now(store)
        return all(now - o.last_modified > GRACE_S for o in store.list("retired/"))

    wait_for("the retired checkpoints to pass gc's grace", old_enough)

    proxy = s3_proxy()
    proxy.hold("POST", "?delete")  # DeleteObjects: gc's delete leaves, and is slow to arrive
    gc_store = open_store(s3_uri, S3Settings(endpoint_url=proxy.endpoint))
    with cf.ThreadPoolExecutor(2) as pool:
        gc = pool.submit(repo.collect_garbage, gc_store, grace_s=GRACE_S)
        wait_for("gc's delete to be in flight", proxy.holding.is_set)
        runs = runs_in(store.list(MARKERS))
        (run,) = [r for r in runs.values() if r.phase is Phase.SWEEPING]
        assert zeros_chunks <= parse_keys(store.get(marker_key(run.run, Phase.SWEEPING)), "sweep")

        save4 = pool.submit(lambda: ckpt.save(4, model=model_with(True, 4)).result())  # type: ignore[union-attr]
        wait_for(
            "save 4 to wait for the gc run before naming its chunks",
            lambda: f"waiting for gc run {run.run} to finish deleting" in caplog.text,
        )
        assert not list(store.list(manifest_key(4)))  # nothing names the chunk yet
        proxy.release()  # the delete lands: Z (stored again by save 4) is gone for a moment
        report = gc.result(timeout=60)
        assert report.deleted_chunks >= len(zeros_chunks)
        save4.result(timeout=120)
    assert "storing them once more" in caplog.text
    ckpt.close()

    assert repo.committed_steps(store) == [4]
    manifest = repo.read_manifest(store, 4)
    assert zeros_chunks <= {c.key for f in manifest.files.values() for c in f.chunks}
    assert not verify(store, manifest)
    fresh = model_with(False, 99)
    loaded = Checkpointer(config).load(model=fresh)
    assert loaded is not None and loaded.step == 4
    assert torch.count_nonzero(fresh.state_dict()["0.weight"]) == 0


def test_an_unreadable_retired_manifest_names_nothing_and_gc_goes_on(s3_uri: str) -> None:
    config = CheckpointConfig(uri=s3_uri, mode=Mode.FULL, keep_last=1, gc_grace_s=3600)
    with Checkpointer(config) as ckpt:
        for step in (1, 2):
            ckpt.save(step, model=model_with(False, step)).result()  # type: ignore[union-attr]
        store = ckpt.store
    store.put(retired_key(1), b'{"format": "ctj-checkpoint", "version": 3, "step": [')
    report = repo.collect_garbage(store, grace_s=0)  # crashed on the JSON before
    assert report.deleted_chunks > 0  # step 1's chunks: nothing readable names them
    assert not verify(store, repo.read_manifest(store, 2))


def test_gc_that_cannot_sweep_says_so_in_a_metric(s3_uri: str) -> None:
    """A young retired checkpoint whose rank manifest is corrupt stops gc before any delete
    (what it names is unknown); the gauge says so until a gc completes again."""
    config = CheckpointConfig(uri=s3_uri, mode=Mode.FULL, keep_last=1, gc_grace_s=3600)
    blocked = "ctj_checkpoint_gc_blocked"
    with Checkpointer(config) as ckpt:
        ckpt.save(1, model=model_with(False, 1)).result()  # type: ignore[union-attr]
        store = ckpt.store
        key = repo.read_manifest(store, 1).ranks[0].key
        store.put(key, store.get(key) + b" ")  # step 1 still live: retired by save 2
        ckpt.save(2, model=model_with(False, 2)).result()  # type: ignore[union-attr]
        registry = ckpt.metrics.registry
        wait_for("gc after step 2 to stop", lambda: registry.get_sample_value(blocked) == 1)
        assert repo.committed_steps(store) == [2]  # 1 retired, still young: gc reads it
        store.delete([retired_key(1)])  # the fix: that checkpoint goes
        ckpt.save(3, model=model_with(False, 3)).result()  # type: ignore[union-attr]
        wait_for("gc after step 3 to complete", lambda: registry.get_sample_value(blocked) == 0)
