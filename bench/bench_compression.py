"""Compression that pays: zstd levels and byte-plane splits on a trained model's state (issue 13).

What is measured, in one run:

1. A small causal transformer LM (token embedding, 4 pre-norm blocks of multi-head
   attention and a GELU MLP, an untied head) is trained for a few hundred AdamW steps
   on CPU, one torch thread, on structured synthetic text (a sparse random Markov
   chain over the vocabulary: each token has 4 possible successors), so its weights
   and optimizer state have moved from their initialisation the way real ones do.
2. Its state, in the classes a checkpoint holds: fp32 weights, AdamW ``exp_avg`` and
   ``exp_avg_sq`` (fp32), bf16 and fp16 copies of the weights, and the small tensors
   (biases, norms, step counts) that the engine packs together. Each class is laid
   out and cut into chunks exactly as the engine cuts a staged file
   (format/chunking.plan_chunks: 8 MiB pieces of each large tensor, 256 KiB packs).
3. Per class and codec variant: the compression ratio (raw / stored bytes) and the
   compress and decompress speeds in MB per CPU-second of the one thread doing it
   (``time.thread_time``, best of ``--repeats``: on a shared machine wall time is
   noise, the CPU a codec burns is not). Variants: the engine's codecs
   (format/codecs.py: ``none``, ``zstd`` and the byte-plane ``zstd-bp2``/``zstd-bp4``,
   level 1) and, for comparison only, zstd levels 3 and 9 with and without the split,
   the planes in one zstd frame instead of one each, and an exponent-aligned split
   (each element rotated left one bit first, so a whole byte is the exponent).
   Every variant is checked to round-trip.
4. The choice per class: the best ratio among the engine's codecs that compress at
   ``--min-mb-per-cpu-s`` or faster (default 200), none below a 1.05 ratio; it is
   compared with what ``compression="auto"`` does (format/codecs.AUTO). Beside it the
   break-even bandwidth ``c * (1 - 1/r)``: the bytes a codec saves per CPU-second it
   burns, which is also the upload bandwidth per compressing core below which
   compressing shortens a save whose CPU and network time add up.
5. Save time: ``Checkpointer.save`` of the trained state (fp32 weights, AdamW state
   and a bf16 copy of the weights, as mixed-precision training holds them), repeated
   ``--save-mib`` big (each copy's lowest mantissa bits flipped by a per-copy pattern,
   so no copy deduplicates against another and the bytes' statistics stay as trained),
   to an S3 server on loopback (moto unless ``--s3 seaweedfs`` or ``--endpoint-url``),
   with ``compression`` none, zstd and auto; each a full save to a fresh prefix, the
   variants interleaved ``--save-repeats`` times. Reported: seconds from ``save`` to
   the commit, CPU seconds of this process (all its threads) and of the server
   meanwhile, bytes stored, and a load back (checked bitwise) with its seconds.

Usage:

    source hack/env.sh
    python bench/bench_compression.py --json /tmp/compression.json   # a few minutes
    python bench/bench_compression.py --quick --json /tmp/quick.json # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import bench_checkpoint
import numpy as np
import zstandard
from bench_async import process_cpu_seconds
from bench_checkpoint import (
    CREDENTIALS,
    MIB,
    REGION,
    add_s3_arguments,
    create_bucket,
    engine_info,
    log,
    machine,
    s3_server,
)

from trainer_sidecar.format import chunking, codecs
from trainer_sidecar.format.manifest import Codec

MIN_RATIO = 1.05  # below this a codec is not worth whole-chunk reads: store raw
GOAL_FP32_OPTIMIZER = 1.15  # issue 13 / DESIGN.md: lossless compression of fp32 state


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int
    steps: int
    lr: float = 1e-3


FULL = ModelShape(vocab=2048, dim=256, layers=4, heads=4, seq=32, batch=4, steps=300)
QUICK = ModelShape(vocab=4096, dim=64, layers=2, heads=2, seq=16, batch=4, steps=20)


# --------------------------------------------------------------------------- the model


def build_lm(shape: ModelShape) -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = shape.dim
            self.ln1 = torch.nn.LayerNorm(d)
            self.attn = torch.nn.MultiheadAttention(d, shape.heads, batch_first=True)
            self.ln2 = torch.nn.LayerNorm(d)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
            )

        def forward(self, x: Any, mask: Any) -> Any:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(shape.vocab, shape.dim)
            self.pos = torch.nn.Parameter(torch.randn(shape.seq, shape.dim) * 0.02)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(shape.layers))
            self.ln = torch.nn.LayerNorm(shape.dim)
            self.head = torch.nn.Linear(shape.dim, shape.vocab, bias=False)

        def forward(self, idx: Any) -> Any:
            mask = torch.nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
            x = self.emb(idx) + self.pos[: idx.shape[1]]
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln(x))

    return LM()


def train(shape: ModelShape) -> tuple[Any, Any, dict[str, Any]]:
    """(model, AdamW optimizer, what the training did), trained on a Markov chain's text."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)  # 2 threads on a shared 2-core machine spin far slower
    model = build_lm(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    successors = torch.randint(0, shape.vocab, (shape.vocab, 4), generator=gen)

    def batch() -> tuple[Any, Any]:
        x = torch.empty(shape.batch, shape.seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, shape.vocab, (shape.batch,), generator=gen)
        for t in range(shape.seq):
            pick = torch.randint(0, 4, (shape.batch,), generator=gen)
            x[:, t + 1] = successors[x[:, t], pick]
        return x[:, :-1], x[:, 1:]

    started, cpu = time.perf_counter(), time.process_time()
    losses = []
    for _ in range(shape.steps):
        x, y = batch()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, shape.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "steps": shape.steps,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu,
        "loss_first": losses[0],
        "loss_last": statistics.fmean(losses[-10:]),
        "loss_floor": math.log(4),  # 4 equally likely successors
    }
    return model, opt, info


# --------------------------------------------------------------------------- the classes


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    data: bytes
    dtypes: tuple[str, ...]  # codecs.chunk_dtypes: what auto sees in it


@dataclasses.dataclass(frozen=True, slots=True)
class TensorClass:
    name: str
    width: int  # element size of the byte-plane variants measured
    chunks: tuple[Chunk, ...]

    @property
    def raw_bytes(self) -> int:
        return sum(len(c.data) for c in self.chunks)


def raw_bytes(t: Any) -> bytes:
    import torch

    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def lay_out(tensors: list[Any]) -> list[Chunk]:
    """The tensors end to end, cut into chunks as the engine cuts a staged file."""
    from trainer_sidecar.save.staging import dtype_name

    items, blobs, offset = [], [], 0
    for t in tensors:
        blob = raw_bytes(t)
        items.append(chunking.Span(offset, len(blob), dtype_name(t.dtype)))
        blobs.append(blob)
        offset += len(blob)
    whole = b"".join(blobs)
    spans = chunking.plan_chunks(
        items, file_size=len(whole), chunk_size=chunking.DEFAULT_CHUNK_SIZE
    )
    kinds = codecs.chunk_dtypes(items, spans)
    return [Chunk(whole[s.offset : s.end], k) for s, k in zip(spans, kinds, strict=True)]


def tensor_classes(model: Any, opt: Any) -> list[TensorClass]:
    pack = chunking.DEFAULT_PACK_SIZE
    weights = list(model.state_dict().values())
    states = [opt.state[p] for p in model.parameters()]
    exp_avg = [s["exp_avg"] for s in states]
    exp_avg_sq = [s["exp_avg_sq"] for s in states]
    steps = [s["step"] for s in states]

    def large(ts: list[Any]) -> list[Any]:
        return [t for t in ts if t.numel() * t.element_size() > pack]

    def small(ts: list[Any]) -> list[Any]:
        return [t for t in ts if t.numel() * t.element_size() <= pack]

    out = [
        TensorClass("fp32 weights", 4, tuple(lay_out(large(weights)))),
        TensorClass("fp32 adam exp_avg", 4, tuple(lay_out(large(exp_avg)))),
        TensorClass("fp32 adam exp_avg_sq", 4, tuple(lay_out(large(exp_avg_sq)))),
        TensorClass("bf16 weights", 2, tuple(lay_out(large([t.bfloat16() for t in weights])))),
        TensorClass("fp16 weights", 2, tuple(lay_out(large([t.half() for t in weights])))),
        TensorClass(
            "fp32 small tensors (packs)",
            4,
            tuple(lay_out(small(weights) + small(exp_avg) + small(exp_avg_sq) + steps)),
        ),
    ]
    return [c for c in out if c.chunks]


# --------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    name: str
    engine: bool  # one of the engine's codecs (a candidate for the choice)
    encode: Callable[[bytes], bytes]
    decode: Callable[[bytes, int], bytes]


def _zstd(level: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=level)


def _one_frame(data: bytes, size: int) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


def _rotate(data: bytes, width: int, left: bool) -> bytes:
    """Each element rotated by one bit: left puts the exponent in the top byte whole."""
    kind = {2: np.uint16, 4: np.uint32}[width]
    bits = 8 * width
    m = len(data) // width
    a = np.frombuffer(data, dtype=kind, count=m)
    r = (a << 1) | (a >> (bits - 1)) if left else (a >> 1) | (a << (bits - 1))
    return r.astype(kind).tobytes() + data[m * width :]


def _decoder(codec: Codec) -> Callable[[bytes, int], bytes]:
    return lambda data, size: codecs.decode(data, codec, size=size)


def variants(width: int) -> list[Variant]:
    bp = {2: Codec.ZSTD_BP2, 4: Codec.ZSTD_BP4}[width]
    out: list[Variant] = []
    for codec in (Codec.NONE, Codec.ZSTD, bp):
        out.append(
            Variant(
                codec.value,
                True,
                functools.partial(codecs.encode, codec=codec),
                _decoder(codec),
            )
        )
    for level in (3, 9):
        cctx = _zstd(level)
        out.append(Variant(f"zstd L{level}", False, cctx.compress, _one_frame))
        out.append(
            Variant(
                f"{bp.value} L{level}",
                False,
                functools.partial(codecs.encode, codec=bp, level=level),
                _decoder(bp),
            )
        )
    one = _zstd(1)
    out.append(
        Variant(
            f"{bp.value} one frame",
            False,
            lambda d: one.compress(b"".join(p.tobytes() for p in codecs.planes(d, width))),
            lambda d, n: codecs.unplanes(_one_frame(d, n), width),
        )
    )
    out.append(
        Variant(
            f"{bp.value} exponent-aligned",
            False,
            lambda d: codecs.encode(_rotate(d, width, True), bp),
            lambda d, n: _rotate(codecs.decode(d, bp, size=n), width, False),
        )
    )
    return out


def measure_variant(cls: TensorClass, v: Variant, repeats: int) -> dict[str, Any]:
    stored = [v.encode(c.data) for c in cls.chunks]
    for c, s in zip(cls.chunks, stored, strict=True):
        if v.decode(s, len(c.data)) != c.data:
            raise AssertionError(f"{v.name} does not round-trip on {cls.name}")
    comp = dec = math.inf
    for _ in range(repeats):
        t = time.thread_time()
        for c in cls.chunks:
            v.encode(c.data)
        comp = min(comp, time.thread_time() - t)
        t = time.thread_time()
        for c, s in zip(cls.chunks, stored, strict=True):
            v.decode(s, len(c.data))
        dec = min(dec, time.thread_time() - t)
    raw, size = cls.raw_bytes, sum(map(len, stored))
    ratio = raw / size
    c_speed = raw / max(comp, 1e-9) / 1e6
    return {
        "variant": v.name,
        "engine": v.engine,
        "ratio": ratio,
        "stored_bytes": size,
        "compress_mb_per_cpu_s": c_speed,
        "decompress_mb_per_cpu_s": raw / max(dec, 1e-9) / 1e6,
        "compress_cpu_s_per_gib": comp / raw * 2**30,
        "break_even_mb_per_s": c_speed * (1 - 1 / ratio) if v.name != "none" else None,
    }


def choose(rows: list[dict[str, Any]], min_speed: float) -> str:
    """The best ratio among the engine's codecs fast enough; none below MIN_RATIO."""
    fast = [
        r
        for r in rows
        if r["engine"] and r["variant"] != "none" and r["compress_mb_per_cpu_s"] >= min_speed
    ]
    best = max(fast, key=lambda r: r["ratio"], default=None)
    return best["variant"] if best and best["ratio"] >= MIN_RATIO else "none"


def auto_codec(cls: TensorClass) -> str:
    """What the engine's ``auto`` stores this class's chunks with (the most raw bytes)."""
    by: dict[str, int] = {}
    for c in cls.chunks:
        name = codecs.choose(codecs.Compression.AUTO, c.dtypes).value
        by[name] = by.get(name, 0) + len(c.data)
    return max(by, key=lambda k: by[k])


def measure_codecs(classes: list[TensorClass], opts: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for cls in classes:
        log(f"codecs: {cls.name} ({cls.raw_bytes / MIB:.1f} MiB, {len(cls.chunks)} chunks)")
        rows = [measure_variant(cls, v, opts.repeats) for v in variants(cls.width)]
        chosen = choose(rows, opts.min_mb_per_cpu_s)
        out.append(
            {
                "class": cls.name,
                "raw_bytes": cls.raw_bytes,
                "chunks": len(cls.chunks),
                "variants": rows,
                "chosen": chosen,
                "auto": auto_codec(cls),
            }
        )
    return out


# --------------------------------------------------------------------------- the save


def replicate(model: Any, opt: Any, copies: int) -> tuple[Any, Any]:
    """``copies`` of the trained fp32 model with its AdamW state, and a bf16 copy of each
    one's weights, as one module and one optimizer. Copy i > 0 has the lowest byte of
    every element XORed with i: nothing deduplicates, the statistics stay."""
    import torch

    def flip(t: Any, i: int) -> Any:
        t = t.detach().clone()
        if i and t.is_floating_point() and t.numel():
            view = t.view({4: torch.int32, 2: torch.int16}[t.element_size()])
            view ^= i & 0x7F  # bf16: bit 7 of the low byte is the exponent's: untouched
        return t

    src = [opt.state[p] for p in model.parameters()]
    mods: dict[str, Any] = {}
    params: list[Any] = []
    state: dict[Any, Any] = {}
    for i in range(copies):
        fp32 = copy.deepcopy(model)
        bf16 = copy.deepcopy(model).to(torch.bfloat16).requires_grad_(False)
        with torch.no_grad():
            for p in fp32.parameters():
                p.copy_(flip(p, i))
            for p in bf16.parameters():
                p.copy_(flip(p, i))
        for p, s in zip(fp32.parameters(), src, strict=True):
            state[p] = {
                "step": s["step"].clone(),
                "exp_avg": flip(s["exp_avg"], i),
                "exp_avg_sq": flip(s["exp_avg_sq"], i),
            }
        params += list(fp32.parameters())
        mods[f"copy{i}"] = fp32
        mods[f"copy{i}_bf16"] = bf16
    container = torch.nn.ModuleDict(mods)
    new_opt = torch.optim.AdamW(params, lr=opt.param_groups[0]["lr"], weight_decay=0.1)
    new_opt.state.update(state)
    return container, new_opt


def state_bytes(container: Any, opt: Any) -> int:
    n = sum(t.numel() * t.element_size() for t in container.state_dict().values())
    for s in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values())
    return n


def snapshot(container: Any, opt: Any) -> list[bytes]:
    out = [raw_bytes(t) for t in container.state_dict().values()]
    for p in (p for g in opt.param_groups for p in g["params"]):
        out += [raw_bytes(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def zeroed(container: Any) -> tuple[Any, Any]:
    """A container of the same shape, zeroed, with a fresh optimizer to load into."""
    import torch

    fresh = copy.deepcopy(container)
    with torch.no_grad():
        for t in fresh.state_dict().values():
            t.zero_()
    params = [p for p in fresh.parameters() if p.requires_grad]
    return fresh, torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def stored_bytes(client: Any, bucket: str, prefix: str) -> tuple[int, dict[str, int]]:
    """Bytes under prefix/chunks/, and how many chunks each codec suffix has."""
    total, by = 0, dict[str, int]()
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/chunks/"
    )
    for page in pages:
        for o in page.get("Contents", []):
            total += o["Size"]
            name = o["Key"].rsplit("/", 1)[-1]
            suffix = name[64:] or "(raw)"
            by[suffix] = by.get(suffix, 0) + 1
    return total, by


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [{"Key": o["Key"]} for page in pages for o in page.get("Contents", [])]
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})


def measure_saves(model: Any, opt: Any, opts: argparse.Namespace, staging: str) -> dict[str, Any]:
    import boto3

    from trainer_sidecar import CheckpointConfig, Checkpointer

    one = state_bytes(*replicate(model, opt, 1))
    copies = max(1, round(opts.save_mib * MIB / one)) if opts.save_mib else 1
    container, big_opt = replicate(model, opt, copies)
    total = state_bytes(container, big_opt)
    want = snapshot(container, big_opt)
    log(f"save: {copies} copies of the trained state, {total / MIB:.0f} MiB")
    rows: dict[str, list[dict[str, Any]]] = {c.value: [] for c in codecs.Compression}
    with s3_server(opts.endpoint_url, opts.s3) as (endpoint, server, server_pid):
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
        os.environ["CTJ_STAGING_DIR"] = staging
        bucket = create_bucket(endpoint)
        client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
        order = list(codecs.Compression)
        for r in range(opts.save_repeats):
            for compression in order[r % len(order) :] + order[: r % len(order)]:
                prefix = f"{compression.value}-{r}-{uuid.uuid4().hex[:6]}"
                config = CheckpointConfig(
                    uri=f"s3://{bucket}/{prefix}", compression=compression, keep_last=0
                )
                with Checkpointer(config) as ckpt:
                    cpu, scpu = process_cpu_seconds(), process_cpu_seconds(server_pid)
                    started = time.perf_counter()
                    pending = ckpt.save(1, model=container, optimizer=big_opt)
                    assert pending is not None
                    result = pending.result()
                    seconds = time.perf_counter() - started
                    cpu = process_cpu_seconds() - cpu
                    server_cpu = process_cpu_seconds(server_pid) - scpu if server_pid else None
                    size, by_codec = stored_bytes(client, bucket, prefix)
                    fresh, fresh_opt = zeroed(container)
                    t = time.perf_counter()
                    loaded = ckpt.load(model=fresh, optimizer=fresh_opt)
                    load_s = time.perf_counter() - t
                    assert loaded is not None and loaded.step == 1
                    if snapshot(fresh, fresh_opt) != want:
                        raise AssertionError(f"{compression}: the load is not bitwise equal")
                delete_prefix(client, bucket, prefix)  # keep the in-memory server small
                rows[compression.value].append(
                    {
                        "seconds": seconds,
                        "cpu_seconds": cpu,
                        "server_cpu_seconds": server_cpu,
                        "stored_bytes": size,
                        "logical_bytes": result.logical_bytes,
                        "chunks_by_suffix": by_codec,
                        "load_seconds": load_s,
                        "load_bytes_fetched": loaded.bytes_fetched,
                    }
                )
                log(
                    f"  {compression.value:<5} {seconds:6.2f} s  {cpu:6.2f} cpu-s  "
                    f"{size / MIB:7.1f} MiB stored  load {load_s:5.2f} s"
                )
    summary = {}
    base = rows["none"][0]["stored_bytes"]
    for name, runs in rows.items():

        def med(key: str, runs: list[dict[str, Any]] = runs) -> float | None:
            vals = [r[key] for r in runs if r[key] is not None]
            return statistics.median(vals) if vals else None

        summary[name] = {
            "seconds": med("seconds"),
            "cpu_seconds": med("cpu_seconds"),
            "server_cpu_seconds": med("server_cpu_seconds"),
            "stored_bytes": runs[0]["stored_bytes"],
            "ratio": base / runs[0]["stored_bytes"],  # vs none's stored bytes
            "load_seconds": med("load_seconds"),
            "load_bytes_fetched": runs[0]["load_bytes_fetched"],
            "chunks_by_suffix": runs[0]["chunks_by_suffix"],
            "runs": runs,
        }
    return {"server": server, "copies": copies, "state_bytes": total, "by_compression": summary}


# --------------------------------------------------------------------------- report


def run(opts: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    shape = QUICK if opts.quick else dataclasses.replace(FULL, steps=opts.steps or FULL.steps)
    log(f"training a {shape.layers}-layer LM for {shape.steps} AdamW steps on 1 thread")
    model, opt, trained = train(shape)
    log(
        f"  {trained['params'] / 1e6:.2f} M params, {trained['seconds']:.0f} s, loss "
        f"{trained['loss_first']:.2f} -> {trained['loss_last']:.2f} "
        f"(floor {trained['loss_floor']:.2f})"
    )
    classes = tensor_classes(model, opt)
    measured = measure_codecs(classes, opts)
    staging = tempfile.mkdtemp(prefix="ctj-bench-staging-", dir=_shm())
    try:
        saves = measure_saves(model, opt, opts, staging) if not opts.no_save else None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    chosen = {m["class"]: m["chosen"] for m in measured}
    agrees = {m["class"]: m["chosen"] == m["auto"] for m in measured}
    ratios: dict[str, float] = {}
    for m in measured:
        by = {r["variant"]: r for r in m["variants"]}
        key = m["class"].replace(" ", "_").replace("(", "").replace(")", "")
        ratios[f"{key}_ratio_auto"] = by[m["auto"]]["ratio"]
        ratios[f"{key}_ratio_zstd"] = by["zstd"]["ratio"]
    targets = {}
    for m in measured:
        if m["class"].startswith("fp32 adam"):
            by = {r["variant"]: r for r in m["variants"]}
            value = by[m["auto"]]["ratio"]
            targets[m["class"].replace(" ", "_") + "_ratio_auto"] = {
                "value": value,
                "target": f">= {GOAL_FP32_OPTIMIZER}",
                "met": value >= GOAL_FP32_OPTIMIZER,
            }
    if saves:
        base = saves["by_compression"]["none"]
        for name, s in saves["by_compression"].items():
            if name != "none":
                ratios[f"save_seconds_ratio_{name}_vs_none"] = s["seconds"] / base["seconds"]
                ratios[f"save_stored_bytes_ratio_{name}_vs_none"] = (
                    s["stored_bytes"] / base["stored_bytes"]
                )
                ratios[f"save_cpu_seconds_ratio_{name}_vs_none"] = (
                    s["cpu_seconds"] / base["cpu_seconds"]
                )
    return {
        "command": " ".join(["python", "bench/bench_compression.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "model": dataclasses.asdict(shape),
            "quick": opts.quick,
            "repeats": opts.repeats,
            "min_mb_per_cpu_s": opts.min_mb_per_cpu_s,
            "min_ratio": MIN_RATIO,
            "chunk_size": chunking.DEFAULT_CHUNK_SIZE,
            "pack_size": chunking.DEFAULT_PACK_SIZE,
            "zstandard": zstandard.__version__,
            "libzstd": zstandard.ZSTD_VERSION,
        },
        "engine": engine_info(),
        "machine": machine(),
        "training": trained,
        "classes": measured,
        "chosen": chosen,
        "auto_agrees_with_measurement": agrees,
        "saves": saves,
        "ratios": ratios,
        "targets": targets,
    }


def _shm() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{'class / variant':<44}{'ratio':>7}{'comp MB/cpu-s':>15}{'decomp MB/cpu-s':>17}"
        f"{'break-even MB/s':>17}",
        "-" * 100,
    ]
    for m in report["classes"]:
        lines.append(f"{m['class']} ({m['raw_bytes'] / MIB:.1f} MiB, {m['chunks']} chunks)")
        for r in m["variants"]:
            mark = " *" if r["variant"] == m["chosen"] else ("  " if r["engine"] else " (ref)")
            be = r["break_even_mb_per_s"]
            speeds = (
                f"{'-':>15}{'-':>17}"
                if r["variant"] == "none"
                else f"{r['compress_mb_per_cpu_s']:>15.0f}{r['decompress_mb_per_cpu_s']:>17.0f}"
            )
            lines.append(
                f"  {r['variant'] + mark:<42}{r['ratio']:>7.3f}{speeds}"
                f"{'' if be is None else f'{be:.0f}':>17}"
            )
    lines += ["", "* chosen (best ratio among the engine's codecs fast enough); auto does:"]
    for m in report["classes"]:
        same = "same" if m["auto"] == m["chosen"] else "DIFFERENT"
        lines.append(f"  {m['class']:<40} chosen {m['chosen']:<10} auto {m['auto']:<10} {same}")
    saves = report["saves"]
    if saves:
        lines += [
            "",
            f"save of {saves['state_bytes'] / MIB:.0f} MiB ({saves['copies']} copies) to "
            f"{saves['server']}, medians:",
            f"{'compression':<14}{'seconds':>9}{'cpu-s':>8}{'server cpu-s':>14}"
            f"{'MiB stored':>12}{'ratio':>8}{'load s':>9}",
        ]
        for name, s in saves["by_compression"].items():
            scpu = s["server_cpu_seconds"]
            lines.append(
                f"{name:<14}{s['seconds']:>9.2f}{s['cpu_seconds']:>8.2f}"
                f"{'' if scpu is None else f'{scpu:.2f}':>14}{s['stored_bytes'] / MIB:>12.1f}"
                f"{s['ratio']:>8.3f}{s['load_seconds']:>9.2f}"
            )
    lines += bench_checkpoint.ratio_lines(report, width=56)
    for name, t in report["targets"].items():
        if name not in report["ratios"]:
            lines.append(
                f"{name:<56}{t['value']:>8.3f}  {t['target']:<8}  {'yes' if t['met'] else 'NO'}"
            )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures and ratios here")
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--steps", type=int, help=f"training steps (default {FULL.steps})")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (best of)")
    parser.add_argument(
        "--min-mb-per-cpu-s",
        type=float,
        default=200.0,
        help="slowest compression a default may have (MB per CPU-second; default 200)",
    )
    parser.add_argument(
        "--save-mib", type=int, default=256, help="state size of the save phase (default 256)"
    )
    parser.add_argument("--save-repeats", type=int, default=3, help="saves per compression")
    parser.add_argument("--no-save", action="store_true", help="skip the save phase")
    add_s3_arguments(parser)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.repeats, opts.save_mib, opts.save_repeats = 1, 0, 1
    return opts


def main(argv: list[str] | None = None) -> int:
    return bench_checkpoint.script_main(argv, parse_args=parse_args, run=run, table=table)


if __name__ == "__main__":
    sys.exit(main())
