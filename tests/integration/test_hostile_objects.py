"""Hostile objects on a real S3 server: a record that claims more than it holds costs a
reader about its own size, and is refused as a corrupt checkpoint is.

Each kind is planted the way a bucket writer would (docs/format.md, "Limits: what a
reader trusts"), as step 2 next to a good step 1, and then load falls back to step 1,
``ctj checkpoints verify`` / ``show`` / ``ls`` / ``gc`` report it without a traceback,
and a starting sidecar serves and keeps saving. Each is measured: the peak of traced
memory (tracemalloc, in this process) or the sidecar's peak RSS must stay within what
the same operation costs on the good checkpoint, plus the planted objects' own size,
plus a fixed allowance; allocating any claim below (60 MiB at the least) fails that.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

from tests.conftest import traced_peak
from tests.integration.test_safe_loading import (
    blank_extra,
    committed,
    model,
    save_steps,
    saved_extra,
)
from tests.integration.test_sidecar import Sidecar, sidecar_config, wait_until
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.cli import main as ctj
from trainer_sidecar.errors import UnsafeCheckpointError
from trainer_sidecar.format.chunking import hash_chunk
from trainer_sidecar.format.manifest import (
    METADATA_FILE,
    ChunkRef,
    FileEntry,
    Mode,
    RankManifest,
    RankRef,
    manifest_key,
    rank_digest,
)
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.base import ObjectStore

pytestmark = pytest.mark.integration

MIB = 1 << 20
ALLOWANCE = 16 * MIB  # what one operation may vary by, run to run, beyond the planted bytes


# -- planting ----------------------------------------------------------------------------


def rank0(store: ObjectStore, step: int) -> tuple[dict[str, Any], RankManifest]:
    """The step's manifest (as JSON) and rank 0's rank manifest, read as stored."""
    body = json.loads(store.get(manifest_key(step)))
    ref = RankRef.from_json(body["ranks"][0])
    return body, RankManifest.from_bytes(store.get(ref.key))


def put(store: ObjectStore, key: str, data: bytes) -> int:
    store.put(key, data)
    return len(data)


def replace_rank0(
    store: ObjectStore, step: int, files: dict[str, FileEntry], *, block_size: int | None = None
) -> int:
    """Give rank 0 of ``step`` the chunk lists ``files`` as a bucket writer would: a new rank
    manifest at the hash of its bytes, and the manifest naming it with its files' sizes
    (so that every cross-check a reader makes still holds). The bytes it planted."""
    body, part = rank0(store, step)
    part = dataclasses.replace(part, files=files, block_size=block_size or part.block_size)
    data = part.to_bytes()
    old = body["ranks"][0]
    ref = RankRef(0, rank_digest(data), {n: f.size for n, f in files.items()},
                  old.get("uploaded_bytes", 0), old.get("deduplicated_bytes", 0))  # fmt: skip
    body["ranks"][0] = ref.to_json()
    body["block_size"] = part.block_size
    return put(store, ref.key, data) + put(store, manifest_key(step), json.dumps(body).encode())


def lying_chunk(store: ObjectStore, raw_size: int, blocks: int) -> tuple[ChunkRef, int]:
    """A 20-byte zstd object that decodes to 20 bytes, named by a record claiming
    ``raw_size`` raw bytes (with ``blocks`` block digests)."""
    stored = zstandard.ZstdCompressor().compress(b"x" * 20)
    digest = rank_digest(stored)
    ref = ChunkRef(digest, raw_size, len(stored), "zstd", (digest,) * blocks)
    return ref, put(store, ref.key, stored)


def tensor_file_claiming(store: ObjectStore, raw_size: int, block_size: int) -> int:
    """Rank 0's tensor file of step 2 made one lying chunk of ``raw_size`` bytes."""
    _, part = rank0(store, 2)
    ref, planted = lying_chunk(store, raw_size, max(1, -(-raw_size // block_size)))
    files = dict(part.files)
    files["__0_0.distcp"] = FileEntry(raw_size, (ref,))
    return planted + replace_rank0(store, 2, files, block_size=block_size)


def plant_chunk_claim(store: ObjectStore) -> int:
    """The review's case: 20 bytes whose record claims 384 MiB (above the maximum)."""
    return tensor_file_claiming(store, 384 * MIB, MIB)


def plant_lying_chunk(store: ObjectStore) -> int:
    """A claim within the maximum chunk size that its object does not hold: 60 MiB."""
    return tensor_file_claiming(store, 60 * MIB, MIB)


def plant_block_size(store: ObjectStore) -> int:
    """A block size of 1 GiB, so one digest "covers" a 384 MiB claim (the manifest and the
    rank manifest agree on it)."""
    return tensor_file_claiming(store, 384 * MIB, 1 << 30)


def plant_world_size(store: ObjectStore) -> int:
    """A manifest of well under 1 KB claiming 6,000,000 ranks."""
    body = json.loads(store.get(manifest_key(2)))
    body["world_size"] = 6_000_000
    data = json.dumps(body).encode()
    assert len(data) < 1024
    return put(store, manifest_key(2), data)


def plant_metadata_memo(store: ObjectStore) -> int:
    """A 12-byte .metadata whose pickle stores into memo index 2**24 (the C unpickler
    would size its memo for 2**25 entries: 256 MiB), with a valid hash."""
    body = b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 24) + b"."
    _, part = rank0(store, 2)
    cid, blocks = hash_chunk(body, part.block_size)
    ref = ChunkRef(cid, len(body), len(body), "none", tuple(blocks))
    files = dict(part.files)
    files[METADATA_FILE] = FileEntry(len(body), (ref,))
    return put(store, ref.key, body) + replace_rank0(store, 2, files)


PLANTERS: dict[str, Callable[[ObjectStore], int]] = {
    "chunk-claim": plant_chunk_claim,
    "lying-chunk": plant_lying_chunk,
    "block-size": plant_block_size,
    "world-size": plant_world_size,
    "metadata-memo": plant_metadata_memo,
}

# what a reader says of each (load's warning; verify's line names the same)
REASONS = {
    "chunk-claim": "claims 402653184 raw bytes",
    "lying-chunk": "decompresses to 20 bytes, not its 62914560 raw bytes",
    "block-size": "block size 1073741824",
    "world-size": "claims 6000000 ranks",
    "metadata-memo": "memo entry 16777216",
}


# -- measuring ---------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    peak: int
    rc: int | None = None
    out: str = ""
    err: str = ""
    loaded: Any = None


Operation = Callable[[str, pytest.CaptureFixture[str]], Outcome]


def load(uri: str, capsys: pytest.CaptureFixture[str]) -> Outcome:
    fresh, extra = model(5), blank_extra()
    with traced_peak() as peak:
        loaded = Checkpointer(CheckpointConfig(uri=uri)).load(model=fresh, extra=extra)
    return Outcome(peak[0], loaded=(loaded, fresh, extra))


def cli(*args: str) -> Operation:
    def run(uri: str, capsys: pytest.CaptureFixture[str]) -> Outcome:
        capsys.readouterr()
        with traced_peak() as peak:
            rc = ctj(["checkpoints", args[0], uri, *args[1:]])
        out, err = capsys.readouterr()
        return Outcome(peak[0], rc, out, err)

    return run


def export(uri: str, capsys: pytest.CaptureFixture[str]) -> Outcome:
    """Step 2 exported as plain DCP into a new directory."""
    with tempfile.TemporaryDirectory() as tmp:
        return cli("export", str(Path(tmp) / "out"), "--step", "2")(uri, capsys)


OPERATIONS: dict[str, Operation] = {
    "load": load,
    "verify": cli("verify", "--all"),
    "show": cli("show", "--step", "2"),
    "ls": cli("ls"),
    "gc": cli("gc", "--dry-run"),
    "export": export,
}


def measure(uri: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Outcome]:
    return {name: op(uri, capsys) for name, op in OPERATIONS.items()}


_GOOD: list[dict[str, Outcome]] = []


def measure_good(uri: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Outcome]:
    """What each operation costs on the two good steps: measured on the module's first
    test's bucket, before it plants anything, and kept for the others (every kind saves
    the same two steps, so their good costs differ only by ALLOWANCE's run-to-run noise)."""
    if not _GOOD:
        _GOOD.append(measure(uri, capsys))
    return _GOOD[0]


# -- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(PLANTERS))
def test_a_hostile_object_costs_its_own_size_and_is_refused_like_a_corrupt_one(
    kind: str,
    s3_uri: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = CheckpointConfig(uri=s3_uri, mode=Mode.FULL)
    saved = save_steps(config, [1, 2])
    good = measure_good(s3_uri, capsys)
    assert good["load"].loaded[0].step == 2
    planted = PLANTERS[kind](Checkpointer(config).store)

    with caplog.at_level(logging.WARNING, logger="ctj.checkpoint"):
        hostile = measure(s3_uri, capsys)
    for name, outcome in hostile.items():
        bound = good[name].peak + planted + ALLOWANCE
        assert outcome.peak <= bound, (
            f"{name} peaked at {outcome.peak / MIB:.1f} MiB with a {kind} planted, "
            f"{good[name].peak / MIB:.1f} MiB without (+{planted} bytes planted)"
        )
        assert "Traceback" not in outcome.err, (name, outcome.err)

    # load: step 2 skipped loudly, step 1 loaded whole
    loaded, fresh, extra = hostile["load"].loaded
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (2,), loaded
    assert extra == saved_extra(1)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved[1].items())
    warning = next(
        r.message
        for r in caplog.records
        if r.name == "ctj.checkpoint" and "step 2 is unusable" in r.message
    )
    assert REASONS[kind] in warning and "loading step 1 instead" in warning, warning

    # verify: step 1 ok, step 2 named with the reason
    verify = hostile["verify"]
    assert verify.rc == 1, (verify.out, verify.err)
    assert "step 1: ok" in verify.out, verify.out
    step2 = [line for line in verify.out.splitlines() if line.startswith("step 2:")]
    assert step2 and all(("UNSAFE" in s or "CORRUPT" in s or "unreadable" in s) for s in step2)
    assert any(REASONS[kind] in s for s in step2), step2

    # ls: every step listed, step 2 as unreadable where its manifest is
    ls = hostile["ls"]
    assert ls.rc == 0, (ls.out, ls.err)
    rows = {line.split()[0]: line for line in ls.out.splitlines()[1:]}
    assert set(rows) == {"1", "2"}, ls.out
    assert "unreadable" not in rows["1"]
    assert ("unreadable" in rows["2"]) == (kind in ("world-size", "block-size")), ls.out

    # show: step 2 reported, never a crash (exit 1 where it cannot be read)
    show = hostile["show"]
    assert show.rc in (0, 1), (show.out, show.err)
    assert "step 2" in show.out, show.out

    # export: refuses step 2 in one line (the good run exported it)
    assert good["export"].rc == 0, (good["export"].out, good["export"].err)
    export_ = hostile["export"]
    assert export_.rc in (1, 2) and export_.err.strip(), (export_.out, export_.err)

    # gc: reads every record; stops without deleting rather than crash (exit 2, one line)
    gc = hostile["gc"]
    assert gc.rc in (0, 2), (gc.out, gc.err)
    assert gc.rc == 0 or gc.err.count("\n") == 1, gc.err


@pytest.fixture
def sidecars() -> Iterator[list[Sidecar]]:
    started: list[Sidecar] = []
    yield started
    for s in started:
        s.__exit__()


def vm_hwm(pid: int) -> int:
    """A process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_sidecar_starting_beside_a_hostile_checkpoint_serves_and_keeps_saving(
    s3_uri: str, tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    """The sidecar reads the latest commit at start-up: with a manifest claiming 6,000,000
    ranks as step 2 it starts, stays up and commits (its reference then the good step 1),
    at the memory a sidecar takes beside good checkpoints. (Of the other kinds it reads
    only chunk ids, never a size; test_bounds has its start-up on a MemoryError.)"""
    kind = "world-size"
    config = CheckpointConfig(uri=s3_uri, mode=Mode.FULL)
    save_steps(config, [1, 2])
    staging = tmp_path / "staging"
    sidecars.append(Sidecar(s3_uri, staging, tmp_path / "good.log"))
    good = vm_hwm(sidecars[-1].proc.pid)
    sidecars[-1].__exit__()

    planted = PLANTERS[kind](Checkpointer(config).store)
    sidecars.append(Sidecar(s3_uri, staging, tmp_path / "sidecar.log"))
    sidecar = sidecars[-1]
    started = vm_hwm(sidecar.proc.pid)

    trainer = Checkpointer(sidecar_config(s3_uri, staging))
    net = model(3)
    committed(trainer.save(3, model=net, extra=saved_extra(3)))
    store = Checkpointer(config).store
    wait_until(lambda: 3 in repo.committed_steps(store), "the sidecar to commit step 3")
    assert sidecar.proc.poll() is None, sidecar.text()
    assert sidecar.get("/healthz")[0] == 200 and sidecar.get("/readyz")[0] == 200
    assert "Traceback" not in sidecar.text(), sidecar.text()
    saved = vm_hwm(sidecar.proc.pid)
    assert started <= good + planted + ALLOWANCE, (started / MIB, good / MIB)
    assert saved <= good + planted + 2 * ALLOWANCE, (saved / MIB, good / MIB)

    fresh, extra = model(5), blank_extra()
    loaded = Checkpointer(CheckpointConfig(uri=s3_uri)).load(model=fresh, extra=extra)
    assert loaded is not None and loaded.step == 3 and extra == saved_extra(3)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())


# -- reading with a bound, on the real server ---------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 1000, 1001, 1002, 3 * MIB])
def test_read_bounded_takes_at_most_one_byte_past_the_bound_from_s3(size: int, s3_uri: str) -> None:
    """A ranged GET of bytes 0..1000: the whole of a smaller object (an empty one too: S3
    answers its range 416), the first 1001 bytes of a larger one."""
    from trainer_sidecar.store.base import read_bounded

    store = Checkpointer(CheckpointConfig(uri=s3_uri)).store
    body = bytes(range(256)) * (size // 256 + 1)
    store.put("objects/k", body[:size])
    assert read_bounded(store, "objects/k", 1000) == body[: min(size, 1001)]


class Counting:
    """The store, counting the bytes its gets return."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner, self.returned = inner, 0

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        data = self.inner.get(key, byte_range=byte_range)
        self.returned += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_manifest_larger_than_its_limit_is_read_no_further_than_the_limit(
    s3_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(The limit made 64 KiB for the test: the real one is 256 MiB.) A 4 MiB object in
    place of a manifest is refused after 64 KiB + 1 bytes, and load skips it."""
    from trainer_sidecar.format import manifest as fmt
    from trainer_sidecar.load import checks

    config = CheckpointConfig(uri=s3_uri, mode=Mode.FULL)
    save_steps(config, [1, 2])
    store = Counting(Checkpointer(config).store)
    store.put(manifest_key(2), b" " * (4 * MIB))
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", 64 << 10, raising=False)
    monkeypatch.setattr(checks, "MAX_MANIFEST_BYTES", 64 << 10, raising=False)
    with pytest.raises(UnsafeCheckpointError) as info:
        checks.read_manifest(store, 2)
    assert store.returned == (64 << 10) + 1
    assert "larger than the 65536 bytes a manifest may be" in str(info.value)
    loaded = Checkpointer(config, store=store).load(model=model(5), extra=blank_extra())
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (2,)
