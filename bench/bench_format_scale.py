"""Metadata at scale: what one rank reads of a checkpoint's metadata, format v2 vs v3.

A metadata-only simulation, no tensors: W ranks of ``--rank-gib`` state each (default
1,024 ranks x 1 GiB = 1 TiB; 8 MiB chunks of 1 MiB blocks, so 128 chunks and 1,024 block
digests per rank) are "uploaded" as their part records into an in-memory store, then
committed, loaded and used as a dedup reference through the engine's own code
(``commit.commit``, ``checks.read_manifest``/``bind``, ``ChunkReader``'s file index,
``Persister._reference_chunks``). Every actor reads through a counting view of the store.

    v2 (the anchor): every chunk list of every rank inline in ``manifests/<step>.json``;
                     parts carry their chunk lists; the committer reads all of them.
    v3 (ours):       a small manifest naming one content-addressed rank manifest per rank;
                     parts are pointers; a rank reads the rank manifests it touches.

For each world size it measures, for one actor each: the committer (rank 0); rank 0
opening the checkpoint for a load (manifest, ``.metadata``'s owner, checks, and the
broadcast it pickles); another rank loading at the same world size (what it unpickles
from rank 0's broadcast, plus what it GETs); loads resharded W -> W/2 and W -> 2W (a new
rank touches the files of 2 or 1 old ranks, plus rank 0's values file, as DCP's even
sharding places them); a saving rank's dedup reference (same world size, and after a
resize W -> W/2). Figures: metadata bytes read (GETs plus broadcast received), store
requests, and wall seconds (parse and checks dominate: the store is memory).

    python bench/bench_format_scale.py --json /tmp/scale.json   # 8, 64, 1024 ranks; ~1-2 min
    python bench/bench_format_scale.py --quick                  # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import blake3

from trainer_sidecar.config import CheckpointConfig
from trainer_sidecar.format.chunking import Span
from trainer_sidecar.format.manifest import (
    METADATA_FILE,
    ChunkRef,
    FileEntry,
    Manifest,
    Mode,
    RankManifest,
    RankPart,
    SaveIdentity,
    manifest_key,
    part_key,
    part_prefix,
    rank_manifest_key,
)
from trainer_sidecar.format.policy import Committed, plan_save, reference_ranks
from trainer_sidecar.load.checks import bind, read_manifest
from trainer_sidecar.load.chunk_reader import ChunkReader
from trainer_sidecar.metrics import CheckpointMetrics
from trainer_sidecar.save import slots
from trainer_sidecar.save.persist import Persister
from trainer_sidecar.store import commit as commits
from trainer_sidecar.store.base import ObjectInfo
from trainer_sidecar.store.memory import MemoryStore

ROOT = Path(__file__).resolve().parent.parent

MIB = 1 << 20
STEP = 10
SAVE = SaveIdentity("1", "0123456789abcdef")
VALUES_FILE = "__0_1.distcp"  # rank 0's non-tensor values: every loading rank reads them


class Reader:
    """One actor's view of the store: counts its GETs and the bytes they return."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.requests = 0
        self.bytes = 0

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        data = self.store.get(key, byte_range=byte_range)
        self.requests += 1
        self.bytes += len(data)
        return data

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        self.store.put(key, data, if_absent=if_absent)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.store.list(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.store.delete(keys)


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    bytes: int
    requests: int
    seconds: float


def measure(store: MemoryStore, fn: Callable[[Reader], int]) -> Figure:
    """Run ``fn`` as one actor; it returns bytes received besides GETs (a broadcast)."""
    reader = Reader(store)
    started = time.perf_counter()
    extra = fn(reader)
    return Figure(reader.bytes + extra, reader.requests, time.perf_counter() - started)


def chunk_list(size: int, chunk: int, block: int, rng: random.Random) -> tuple[ChunkRef, ...]:
    refs = []
    for start in range(0, size, chunk):
        n = min(chunk, size - start)
        raw = rng.randbytes(32 * max(1, -(-n // block)))
        digests = tuple(raw[i : i + 32].hex() for i in range(0, len(raw), 32))
        refs.append(ChunkRef(blake3.blake3(raw).hexdigest(), n, n, "none", digests))
    return tuple(refs)


def rank_files(
    rank: int, world: int, rank_bytes: int, chunk: int, block: int, rng: random.Random
) -> dict[str, FileEntry]:
    files = {f"__{rank}_0.distcp": FileEntry(rank_bytes, chunk_list(rank_bytes, chunk, block, rng))}
    if rank == 0:  # the coordinator's values and .metadata (which grows with the ranks)
        for name, size in ((VALUES_FILE, 64 << 10), (METADATA_FILE, 8192 * world)):
            files[name] = FileEntry(size, chunk_list(size, chunk, block, rng))
    return files


def build(world: int, rank_bytes: int, chunk: int, block: int) -> tuple[MemoryStore, MemoryStore]:
    """Every rank's part, uploaded: (the v2 store, the v3 store), not yet committed."""
    v2, v3 = MemoryStore(), MemoryStore()
    rng = random.Random(world)
    for rank in range(world):
        files = rank_files(rank, world, rank_bytes, chunk, block, rng)
        rank_manifest = RankManifest(step=STEP, rank=rank, save=SAVE, block_size=block, files=files)
        body = rank_manifest.to_bytes()
        part = RankPart.of(
            rank_manifest,
            body,
            world_size=world,
            uploaded_bytes=sum(f.size for f in files.values()),
            deduplicated_bytes=0,
            upload_seconds=1.0,
        )
        v3.put(rank_manifest_key(part.manifest), body)
        v3.put(part_key(STEP, SAVE, rank), part.to_bytes())
        legacy = json.loads(part.to_bytes())
        del legacy["manifest"]
        legacy["files"] = {n: f.to_json() for n, f in files.items()}
        v2.put(part_key(STEP, SAVE, rank), json.dumps(legacy, separators=(",", ":")).encode())
    return v2, v3


def commit_v2(store: Reader, world: int, block: int) -> None:
    """Version 2's commit, as it was: every part's chunk lists into one inline manifest."""
    keys = [o.key for o in store.list(part_prefix(STEP, SAVE))]
    parts = [RankPart.from_bytes(store.get(k)) for k in keys]
    files: dict[str, FileEntry] = {}
    for part in parts:
        assert part.inline is not None
        files.update(part.inline)
    manifest = Manifest(
        step=STEP,
        mode="full",
        parent_step=None,
        base_step=STEP,
        since_full=0,
        world_size=world,
        block_size=block,
        files=files,
        logical_bytes=sum(f.size for f in files.values()),
        uploaded_bytes=sum(p.uploaded_bytes for p in parts),
        deduplicated_bytes=0,
        created=time.time(),
        save=SAVE,
    )
    store.put(manifest_key(STEP), manifest.to_bytes(), if_absent=True)
    Manifest.from_bytes(store.get(manifest_key(STEP)))  # the read-back


def commit_v3(store: Reader, world: int, block: int) -> None:
    plan = plan_save(STEP, mode=Mode.FULL, full_every=1, latest=None, save=SAVE)
    commits.commit(store, plan, world_size=world, block_size=block, timings={}, versions={})


def touched(rank: int, new_world: int, old_world: int) -> list[str]:
    """The files a loading rank's DCP plan reads: its overlapping old ranks' tensors, and
    rank 0's values."""
    tensors = [f"__{r}_0.distcp" for r in reference_ranks(rank, new_world, old_world)]
    return [*tensors, VALUES_FILE]


def open_as_rank0(reader: Reader) -> tuple[int, bytes]:
    """Rank 0's part of a load: read and check the manifest, read .metadata's chunk list,
    pickle what it broadcasts. Returns (0, the broadcast)."""
    manifest = read_manifest(reader, STEP)
    ChunkReader(reader, manifest).indexes[METADATA_FILE]
    return 0, pickle.dumps(manifest)


def load_as_rank(broadcast: bytes, files: list[str]) -> Callable[[Reader], int]:
    """Another rank's part: unpickle rank 0's broadcast, then index the files its plan reads
    (ChunkReader's lookup: version 3 fetches those ranks' rank manifests)."""

    def run(reader: Reader) -> int:
        manifest = bind(reader, pickle.loads(broadcast))
        chunks = ChunkReader(reader, manifest)
        for name in files:
            chunks.indexes[name]  # noqa: B018
        return len(broadcast)

    return run


def dedup_as_rank(rank: int, world: int, root: Path) -> Callable[[Reader], int]:
    """A saving rank's reference: the persister's own _reference_chunks."""

    def run(reader: Reader) -> int:
        plan = plan_save(
            STEP + 1,
            mode=Mode.INCREMENTAL,
            full_every=100,
            latest=Committed(STEP, STEP, 0),
            save=SaveIdentity("2", "0123456789abcdef"),
        )
        staged = slots.StagedCheckpoint(
            step=STEP + 1,
            rank=rank,
            world_size=world,
            plan=plan,
            files=((f"__{rank}_0.distcp", (Span(0, 1),)),),
            staged_at=0.0,
            stage_seconds=0.0,
        )
        config = CheckpointConfig(uri=f"file://{root}/store", keep_last=0)
        persister = Persister(reader, config, root=root, metrics=CheckpointMetrics(), rank=rank)
        assert persister._reference_chunks(staged)
        return 0

    return run


def scenarios(world: int) -> list[tuple[str, Callable[[dict[str, Any]], Callable[[Reader], int]]]]:
    """(name, a function of the per-layout context giving the actor)."""
    other = world // 2  # a rank in the middle: neither rank 0 nor the last
    half, double = max(1, world // 2), world * 2
    return [
        ("commit (rank 0)", lambda c: lambda r: c["commit"](r) or 0),
        ("load: rank 0 opens", lambda c: lambda r: open_as_rank0(r)[0]),
        (
            f"load: rank {other}, {world}->{world}",
            lambda c: load_as_rank(c["broadcast"], touched(other, world, world)),
        ),
        (
            f"load: rank {half // 2}, {world}->{half}",
            lambda c: load_as_rank(c["broadcast"], touched(half // 2, half, world)),
        ),
        (
            f"load: rank {double // 2 + 1}, {world}->{double}",
            lambda c: load_as_rank(c["broadcast"], touched(double // 2 + 1, double, world)),
        ),
        (
            f"save dedup: rank {other}, {world}->{world}",
            lambda c: dedup_as_rank(other, world, c["root"]),
        ),
        (
            f"save dedup: rank {half // 2}, {world}->{half}",
            lambda c: dedup_as_rank(half // 2, half, c["root"]),
        ),
    ]


def run_world(world: int, opts: argparse.Namespace) -> list[dict[str, Any]]:
    rank_bytes = int(opts.rank_gib * (1 << 30))
    chunk, block = opts.chunk_mib * MIB, opts.block_mib * MIB
    started = time.perf_counter()
    v2, v3 = build(world, rank_bytes, chunk, block)
    log(f"{world} ranks: parts built in {time.perf_counter() - started:.1f}s")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ctj-bench-scale-") as tmp:
        for layout, store, committer in (("v2", v2, commit_v2), ("v3", v3, commit_v3)):
            context: dict[str, Any] = {
                "commit": lambda r, committer=committer: committer(r, world, block),
                "root": Path(tmp) / layout,
            }
            for name, make in scenarios(world):
                if name.startswith("load: rank") and "broadcast" not in context:
                    context["broadcast"] = open_as_rank0(Reader(store))[1]
                (Path(tmp) / layout).mkdir(exist_ok=True)
                figure = measure(store, make(context))
                rows.setdefault(name, {"ranks": world, "scenario": name})[layout] = (
                    dataclasses.asdict(figure)
                )
            log(f"{world} ranks: {layout} measured")
        top = len(v3.get(manifest_key(STEP)))
        whole = len(v2.get(manifest_key(STEP)))
    out = []
    for row in rows.values():
        row["bytes_ratio_v3_vs_v2"] = row["v3"]["bytes"] / max(1, row["v2"]["bytes"])
        row["seconds_ratio_v3_vs_v2"] = row["v3"]["seconds"] / max(1e-9, row["v2"]["seconds"])
        row["manifest_bytes"] = {"v2": whole, "v3": top}
        out.append(row)
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'ranks':>5}  {'scenario':<30} {'v2 read':>10} {'v3 read':>10} {'v3/v2':>8}  "
        f"{'v2 req':>6} {'v3 req':>6}  {'v2 s':>7} {'v3 s':>7} {'v3/v2':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        a, b = r["v2"], r["v3"]
        lines.append(
            f"{r['ranks']:>5}  {r['scenario']:<30} {_size(a['bytes']):>10} {_size(b['bytes']):>10} "
            f"{r['bytes_ratio_v3_vs_v2']:>8.4f}  {a['requests']:>6} {b['requests']:>6}  "
            f"{a['seconds']:>7.3f} {b['seconds']:>7.3f} {r['seconds_ratio_v3_vs_v2']:>7.3f}"
        )
    lines.append("ratio (v3 / v2): below 1 means v3 reads less; 'read' = GETs + broadcast received")
    return "\n".join(lines)


def log(message: str) -> None:
    print(f"[bench_format_scale] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures and ratios here")
    parser.add_argument("--quick", action="store_true", help="4 and 16 ranks of 64 MiB: seconds")
    parser.add_argument("--ranks", default="8,64,1024", help="world sizes (default 8,64,1024)")
    parser.add_argument("--rank-gib", type=float, default=1.0, help="state per rank (default 1)")
    parser.add_argument("--chunk-mib", type=int, default=8, help="chunk size (default 8)")
    parser.add_argument("--block-mib", type=int, default=1, help="block size (default 1)")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.ranks, opts.rank_gib = "4,16", 1 / 16
    opts.worlds = [int(w) for w in opts.ranks.split(",") if w.strip()]
    return opts


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    rows = [row for world in opts.worlds for row in run_world(world, opts)]
    print(table(rows))
    largest = max(opts.worlds)
    ratios = {
        f"{r['scenario']}@{r['ranks']}": round(r["bytes_ratio_v3_vs_v2"], 6)
        for r in rows
        if r["ranks"] == largest
    }
    report = {
        "command": " ".join(["python", "bench/bench_format_scale.py", *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "worlds": opts.worlds,
            "rank_bytes": int(opts.rank_gib * (1 << 30)),
            "chunk_bytes": opts.chunk_mib * MIB,
            "block_bytes": opts.block_mib * MIB,
            "quick": opts.quick,
        },
        "machine": machine(),
        "rows": rows,
        "ratios": {"bytes_read_v3_vs_v2": ratios},
    }
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=2))
    return 0


def machine() -> dict[str, Any]:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "nproc": os.cpu_count(),
        "mem_gib": round(mem / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
