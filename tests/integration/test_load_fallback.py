"""Load falls back past an unusable checkpoint, and says what really went wrong otherwise.

Unusable: an unreadable manifest, a missing or corrupt ``.metadata``, a corrupt
chunk only one rank reads (every rank then falls back to the same step, no
hang). Not the checkpoint's fault: a store that stops answering is an error
saying so, never "does not match the state being loaded".
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import free_port
from tests.integration.ranks import run_ranks
from tests.integration.test_faults import flip_one_byte
from tests.integration.test_safe_loading import (
    blank_extra,
    committed,
    model,
    replace_files,
    save_steps,
    saved_extra,
)
from trainer_sidecar import CheckpointConfig, Checkpointer, CheckpointError
from trainer_sidecar.errors import StoreUnavailable
from trainer_sidecar.format.manifest import METADATA_FILE, RANKS, Mode, manifest_key
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.base import ObjectInfo, ObjectStore, read_into
from trainer_sidecar.store.s3 import S3Settings, open_store

pytestmark = pytest.mark.integration


def load_falls_back_to_1(
    config: CheckpointConfig,
    saved: dict[int, dict[str, torch.Tensor]],
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fresh, extra = model(5), blank_extra()
    ckpt = Checkpointer(config)
    with caplog.at_level(logging.WARNING, logger="ctj.checkpoint"):
        loaded = ckpt.load(model=fresh, extra=extra)
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (2,), loaded
    assert extra == saved_extra(1)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved[1].items())
    warnings = [r.message for r in caplog.records if r.name == "ctj.checkpoint"]
    assert any("step 2" in w and why in w and "loading step 1 instead" in w for w in warnings), (
        warnings
    )
    failures = ckpt.metrics.registry.get_sample_value(
        "ctj_checkpoint_failures_total", {"stage": "restore"}
    )
    assert failures == 1


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{not json", "its manifest is unreadable"),
        (b'{"format": "something-else", "version": 1}', "not a ctj checkpoint manifest"),
        (b'{"format": "ctj-checkpoint", "version": 99}', "newer than this ctj understands"),
        (b'{"format": "ctj-checkpoint", "version": 2, "step": 2}', "its manifest is unreadable"),
    ],
    ids=["bad-json", "unknown-format", "newer-version", "fields-missing"],
)
def test_an_unreadable_manifest_is_skipped(
    body: bytes, why: str, s3_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = CheckpointConfig(uri=s3_uri)
    saved = save_steps(config, [1, 2])
    Checkpointer(config).store.put(manifest_key(2), body)
    load_falls_back_to_1(config, saved, why, caplog)


def test_a_manifest_without_metadata_is_skipped(
    s3_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = CheckpointConfig(uri=s3_uri)
    saved = save_steps(config, [1, 2])
    store = Checkpointer(config).store
    manifest = repo.read_manifest(store, 2)
    files = {k: v for k, v in manifest.files.items() if k != METADATA_FILE}
    store.put(manifest_key(2), dataclasses.replace(manifest, files=files).to_bytes())
    load_falls_back_to_1(config, saved, ".metadata is missing from the manifest", caplog)


def corrupt(store: ObjectStore, key: str) -> None:
    """Wrong bytes at a key (one byte flipped), as a failing disk or a bucket writer leaves."""
    body = bytearray(store.get(key))
    body[len(body) // 2] ^= 0xFF
    store.put(key, bytes(body))


@pytest.mark.parametrize("damage", ["wrong-bytes", "gone"])
def test_a_bad_rank_manifest_is_skipped(
    damage: str, s3_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Format version 3: rank 0's rank manifest (its chunk lists, ``.metadata``'s among
    them) with wrong bytes, or gone, makes step 2 unusable like a corrupt chunk."""
    config = CheckpointConfig(uri=s3_uri)
    saved = save_steps(config, [1, 2])
    store = Checkpointer(config).store
    manifest = repo.read_manifest(store, 2)
    assert manifest.version == 3 and len(manifest.ranks) == 1
    key = manifest.ranks[0].key
    if damage == "gone":
        store.delete([key])
    else:
        corrupt(store, key)
    why = "is missing" if damage == "gone" else "fails its hash check"
    load_falls_back_to_1(config, saved, f"rank 0's manifest {key} {why}", caplog)


def test_a_metadata_chunk_gone_from_the_store_is_skipped(
    s3_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = CheckpointConfig(uri=s3_uri, mode=Mode.FULL)
    saved = save_steps(config, [1, 2])
    store = Checkpointer(config).store
    (chunk,) = repo.read_manifest(store, 2).files[METADATA_FILE].chunks
    assert chunk.key not in repo.read_manifest(store, 1).chunk_keys()
    store.delete([chunk.key])
    load_falls_back_to_1(config, saved, f"chunk {chunk.id} is missing", caplog)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\x80\x04\x95garbage", "does not unpickle as DCP metadata"),
        (b"", "does not unpickle as DCP metadata"),
        (json.dumps({"not": "a pickle"}).encode(), "does not unpickle as DCP metadata"),
    ],
    ids=["garbage", "empty", "json"],
)
def test_a_corrupt_metadata_is_skipped(
    body: bytes, why: str, s3_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Corrupt but hash-valid (stored as a new chunk the manifest names): the hash check
    can't catch it, the unpickler must."""
    config = CheckpointConfig(uri=s3_uri)
    saved = save_steps(config, [1, 2])
    replace_files(Checkpointer(config).store, 2, {METADATA_FILE: body})
    load_falls_back_to_1(config, saved, why, caplog)


def assert_store_unreachable(exc: BaseException, endpoint: str) -> None:
    message = str(exc)
    assert isinstance(exc, StoreUnavailable), (type(exc), message)
    assert "unreachable" in message and endpoint in message, message
    assert "does not match" not in message, message


def test_a_store_unreachable_from_the_start_is_said_so(
    s3_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CheckpointConfig(uri=s3_uri)
    save_steps(config, [1])
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("CTJ_S3_MAX_ATTEMPTS", "2")
    dead = dataclasses.replace(config, endpoint_url=closed)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(dead).load(model=model(5), extra=blank_extra())
    assert_store_unreachable(info.value, closed)


class StopsAnsweringForChunks:
    """The real store, except that reads of ``dead_keys`` go to an endpoint nobody
    answers on: the store stops answering once the load is inside DCP's read."""

    def __init__(self, inner: ObjectStore, dead: ObjectStore, dead_keys: set[str]) -> None:
        self.inner, self.dead, self.dead_keys = inner, dead, dead_keys
        self.dead_reads = 0

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        if key in self.dead_keys:
            self.dead_reads += 1
            return self.dead.get(key, byte_range=byte_range)
        return self.inner.get(key, byte_range=byte_range)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)


def test_a_store_that_stops_answering_mid_load_is_said_so_not_a_mismatch(
    s3_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = CheckpointConfig(uri=s3_uri)
    save_steps(config, [1, 2])
    real = Checkpointer(config).store
    closed = f"http://127.0.0.1:{free_port()}"
    dead = open_store(s3_uri, S3Settings(endpoint_url=closed, max_attempts=2))
    tensor_chunks = {c.key for c in repo.read_manifest(real, 2).files["__0_0.distcp"].chunks}
    store = StopsAnsweringForChunks(real, dead, tensor_chunks)
    ckpt = Checkpointer(config, store=store)
    with caplog.at_level(logging.WARNING, logger="ctj.checkpoint"):
        with pytest.raises(CheckpointError) as info:
            ckpt.load(model=model(5), extra=blank_extra())
    assert store.dead_reads > 0, "the load never reached the tensor chunks"
    assert_store_unreachable(info.value, closed)
    assert not [r for r in caplog.records if r.name == "ctj.checkpoint"], "it fell back"
    failures = ckpt.metrics.registry.get_sample_value(
        "ctj_checkpoint_failures_total", {"stage": "restore"}
    )
    assert not failures


# -- two ranks ------------------------------------------------------------------


class RecordingStore:
    """The real store, noting every key this rank reads."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.read: list[str] = []

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        self.read.append(key)
        return self.inner.get(key, byte_range=byte_range)

    def get_into(
        self, key: str, into: Sequence[memoryview], *, byte_range: tuple[int, int]
    ) -> int:  # the chunks' reads into the tensors (store/base.py read_into)
        self.read.append(key)
        return read_into(self.inner, key, into, byte_range=byte_range)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def save_two_steps(args: dict[str, Any]) -> None:
    """Rank function: an FSDP2 model (sharded only: no item is replicated) saved at 1, 2."""
    import torch.distributed as dist

    from tests.integration.workers import build, full_state

    net, _ = build("fsdp", seed=0)
    with Checkpointer(CheckpointConfig(uri=args["uri"], mode=Mode.FULL)) as ckpt:
        committed(ckpt.save(1, model=net))
        ref = full_state(net, torch.optim.SGD(net.parameters(), lr=0.1))["model"]
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        committed(ckpt.save(2, model=net))
    if dist.get_rank() == 0:
        torch.save(ref, args["ref"])


def load_and_report(args: dict[str, Any]) -> None:
    """Rank function: load into a fresh FSDP2 model; write what was loaded and read."""
    import torch.distributed as dist

    from tests.integration.workers import assert_bitwise_equal, build, full_state

    net, _ = build("fsdp", seed=123)
    store = RecordingStore(open_store(args["uri"]))
    loaded = Checkpointer(CheckpointConfig(uri=args["uri"]), store=store).load(model=net)
    assert loaded is not None
    got = full_state(net, torch.optim.SGD(net.parameters(), lr=0.1))["model"]
    rank = dist.get_rank()
    if rank == 0:
        assert_bitwise_equal(got, torch.load(args["ref"], weights_only=True))
    report = {"step": loaded.step, "skipped": list(loaded.skipped), "read": store.read}
    Path(f"{args['out']}.{rank}").write_text(json.dumps(report))


_SAVED: dict[str, str] = {}
"""The first test below saves the two steps (two rank processes); the others start from
a copy of its objects, byte for byte, in their own bucket: the same checkpoint, without
two more rank processes each to make it."""


def two_saved_steps(uri: str, ref: Path) -> str:
    """Steps 1 and 2 (save_two_steps) at ``uri``; the path of the model saved at 1."""
    if not _SAVED:
        run_ranks(2, f"{__name__}:save_two_steps", {"uri": uri, "ref": str(ref)}, timeout=180)
        _SAVED.update(uri=uri, ref=str(ref))
        return str(ref)
    source, target = open_store(_SAVED["uri"]), open_store(uri)
    for info in source.list(""):
        target.put(info.key, source.get(info.key))
    return _SAVED["ref"]


@pytest.mark.parametrize("fault", ["chunk-only-rank-1-reads", "metadata", "rank-1-manifest"])
def test_two_ranks_fall_back_together(
    fault: str, s3_uri: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    ref = two_saved_steps(s3_uri, tmp_path / "ref.pt")
    args = {"uri": s3_uri, "ref": ref, "out": str(tmp_path / "report")}
    store = Checkpointer(CheckpointConfig(uri=s3_uri)).store
    manifests = {s: repo.read_manifest(store, s) for s in (1, 2)}
    if fault == "metadata":
        replace_files(store, 2, {METADATA_FILE: b"\x80\x04garbage"})
        bad = None
    elif fault == "rank-1-manifest":  # version 3: rank 1's chunk lists, read by rank 1 alone
        bad = manifests[2].ranks[1].key
        corrupt(store, bad)
    else:
        rank1 = {c.key for c in manifests[2].files["__1_0.distcp"].chunks}
        bad = sorted(rank1 - manifests[1].chunk_keys())[0]
        flip_one_byte(s3_uri, s3_env["AWS_ENDPOINT_URL"], bad)

    run_ranks(2, f"{__name__}:load_and_report", args, timeout=180)  # a hang fails here
    reports = [json.loads(Path(f"{args['out']}.{r}").read_text()) for r in (0, 1)]
    assert [(r["step"], r["skipped"]) for r in reports] == [(1, [2]), (1, [2])], reports
    if bad is not None:  # the corruption was seen by rank 1 alone, and rank 0 followed
        assert bad in reports[1]["read"] and bad not in reports[0]["read"]
    if fault == "chunk-only-rank-1-reads":  # each rank read its own rank manifests, no others
        for rank, report in enumerate(reports):
            ranks_read = {k for k in report["read"] if k.startswith(RANKS)}
            assert ranks_read == {manifests[s].ranks[rank].key for s in (1, 2)}, (rank, ranks_read)
