"""Async saves vs DCP, side by side in one run (issue 3): the stall, host memory, goodput.

Stall (state: default 20 fp32 tensors, 1 GiB in all, FSDP2-sharded over 2 gloo ranks on
CPU; every row saves the same ``{"model", "extra"}`` state dict, built inside the timed
region, to the same S3 server). Each row runs in its own pair of rank processes, so its
memory is its own. Per rank: one warm-up save (our slot and DCP's reused stager allocate
and touch their buffers on the first save), then ``--repeats`` timed saves; a save's
upload is waited for outside the timed region, so staging is measured, not back-pressure.
Figures are the median over repeats of the slowest rank.

* ours: ``Checkpointer.save`` (incremental; in-process persister thread): until it returns.
  It returns once the state is in the staging slot, so "returned" == "safe to modify".
* DCP ``save`` (sync) with s3torchconnector's ``S3StorageWriter``: the whole save.
* DCP ``async_save`` with defaults (the S3StorageWriter is its own BlockingAsyncStager:
  a fresh CPU copy each save): until it returns.
* DCP ``async_save`` with a reused ``DefaultStager(StagingOptions(use_pinned_memory=False,
  use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False))`` (pinned
  memory and non-blocking copies need an accelerator): "returned" when it returns,
  "safe to modify" when its ``staging_completion`` future is done.
* floor: ``dst.copy_(src)`` of the rank's shards into already-touched buffers, timed
  just before each save in every row's processes (the floor row is the ours processes').

With ``--device cuda`` the state lives on the GPU (rank r on GPU r mod the GPU count;
NCCL beside gloo when every rank has a GPU of its own, gloo alone when they share one):
the floor is a device-to-host copy into pinned, touched host buffers (non-blocking
copies, then the stream synchronised), and the reused ``DefaultStager`` gets pinned
memory and non-blocking copies, its best on a GPU. Goodput stays on the CPU
(``--stall-only`` skips it).

Memory: ``Pss`` from /proc/self/smaps_rollup (counts shared and mapped pages once, so our
/dev/shm slot mapped by both the trainer and the uploader is counted once), sampled every
20 ms outside the timed regions (the copies only add pages, so the sample taken right
after a save returns sees what it staged) and during uploads. Extra = peak - Pss just
before the first save; the ratio divides it by the rank's state bytes.

Goodput: a small real training loop (FSDP2 MLP + Adam on 2 ranks, a couple of hundred MB
of state) in three variants: no checkpoints, ours every K steps, DCP sync saves
(S3StorageWriter) every K steps. On a shared machine slow spells would favour whichever
variant ran in calm, so the variants take turns: N / K rounds, each running K steps of
every variant (rotated order). A save comes after the first step of its K, so our upload
overlaps the other K - 1; after each of our segments the benchmark waits for that save to
commit (charged to ours, as "flush"). With ``--saves-per-segment M`` each variant's turn is
M x K steps with a save every K, and ours waits once, for the last save, at the turn's
end: a save that finds the one before still uploading waits for the staging slot inside
the loop, so a checkpoint path that cannot keep up still shows. One warm-up save of each
kind comes first (our slot allocated and touched, DCP's client made).
Goodput = steps / (segments + flushes).

Ratios are ours / anchor, except ``wallclock_reduction_vs_sync`` = 1 - ours / sync
(higher is better); TARGETS holds each target. ``stall_ratio_vs_dcp_best`` divides by
DCP's "safe to modify" time (the guarantee our ``save`` gives on return);
``stall_ratio_vs_dcp_best_returned`` divides by the time its ``async_save`` returned.

Usage:

    source hack/env.sh
    pip install --no-deps s3torchconnector==1.5.0 s3torchconnectorclient==1.5.0 tenacity==9.2.1
    python bench/bench_async.py --json /tmp/async.json          # 1 GiB, a few minutes
    python bench/bench_async.py --quick --json /tmp/quick.json  # smoke run, < 1 minute
    python bench/bench_async.py --device cuda --stall-only      # the stall from a GPU

s3torchconnector is required here (every DCP row writes through it). Without
``--endpoint-url`` a moto server (``--s3 seaweedfs``: SeaweedFS) is started on loopback
for the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import bench_checkpoint
from bench_checkpoint import (
    COLS,
    MIB,
    REGION,
    StateShape,
    add_s3_arguments,
    boto3_client,
    build_model,
    create_bucket,
    engine_info,
    local_shards,
    log,
    machine,
    max_over_ranks,
    over_ranks,
    project_env,
    ratio_lines,
    s3_server,
    s3tc_client_config,
    timed,
)

WORLD = 2
SAMPLE_S = 0.02
SETTLE_S = 0.3
STALL_ROWS = ("ours", "dcp_sync", "dcp_async_default", "dcp_async_stager")
TARGETS: dict[str, tuple[str, float]] = {
    "stall_ratio_vs_floor": ("<=", 1.2),
    "stall_ratio_vs_dcp_best": ("<=", 1.0),
    "extra_memory_ratio": ("<=", 1.1),
    "goodput_ratio_vs_no_checkpoint": (">=", 0.95),
    "goodput_ratio_pinned_vs_no_checkpoint": (">=", 0.97),
    "wallclock_reduction_vs_sync": (">=", 0.20),
}


@dataclasses.dataclass(slots=True)
class RunTotals:
    loop: float = 0.0  # seconds in the K-step segments
    flush: float = 0.0  # seconds waiting, after a segment, for its save to commit
    saves: int = 0
    cpu: float = 0.0  # this rank process's CPU seconds (all threads) in segments + flushes
    server_cpu: float = 0.0  # the S3 server process's CPU seconds meanwhile
    sidecar_cpu: float = 0.0  # the sidecar process's (--placed: ours persists there)
    stalls: list[float] = dataclasses.field(default_factory=list)
    rounds: list[float] = dataclasses.field(default_factory=list)  # seconds, round by round


@dataclasses.dataclass(frozen=True, slots=True)
class MlpShape:
    hidden: int
    layers: int
    batch: int
    steps: int
    every: int  # checkpoint every K steps
    saves: int = 1  # saves per variant's segment in a round; ours is flushed once, at its end


# --------------------------------------------------------------------------- memory


def process_cpu_seconds(pid: int | None = None) -> float:
    """user + system CPU seconds of this process (all threads), or of ``pid`` (0 if None
    is given for a server we did not start)."""
    path = f"/proc/{'self' if pid is None else pid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss in /proc/self/smaps_rollup")


class MemorySampler:
    """Peak Pss of this process, sampled every SAMPLE_S while not paused."""

    def __init__(self) -> None:
        self.baseline = pss_bytes()
        self.peak = self.baseline
        self._running = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pss-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._running.wait(0.1):
                self.sample()
                time.sleep(SAMPLE_S)

    def sample(self) -> None:
        self.peak = max(self.peak, pss_bytes())

    def resume(self) -> None:
        self.sample()
        self._running.set()

    def pause(self) -> None:
        self._running.clear()
        time.sleep(SAMPLE_S * 1.5)  # let a sample in progress finish

    def stop(self) -> None:
        self._stop.set()
        self._running.set()
        self._thread.join()
        self.sample()


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


# --------------------------------------------------------------------------- stall rows


def s3_writer(bucket: str, prefix: str) -> Any:
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(REGION, f"s3://{bucket}/{prefix}", s3client_config=s3tc_client_config())


def delete_prefix(bucket: str, prefix: str) -> None:
    """Rank 0: drop a DCP checkpoint from the server (keeps moto's memory small)."""
    client = boto3_client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [{"Key": o["Key"]} for page in pages for o in page.get("Contents", [])]
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000]})


class Saver:
    """One stall row: ``start(step)`` -> (returned_s, safe_s); ``wait()`` until persisted."""

    def __init__(self, row: str, model: Any, args: dict[str, Any]) -> None:
        self.row, self.model, self.args = row, model, args
        self.bucket = args["bucket"]
        self._wait: Callable[[], Any] = lambda: None
        self.stage_seconds: list[float] = []
        self.ckpt: Any = None
        self.stager: Any = None
        if row == "ours":
            from trainer_sidecar import CheckpointConfig, Checkpointer
            from trainer_sidecar.format.manifest import Mode

            self.ckpt = Checkpointer(
                CheckpointConfig(
                    uri=args["uri"],
                    mode=Mode.INCREMENTAL,
                    keep_last=0,
                    staging_dir=args["staging"],
                )
            )
        if row == "dcp_async_stager":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = args.get("device", "cpu") == "cuda"  # pinned and non-blocking need a GPU
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=gpu,
                    use_shared_memory=True,
                    use_async_staging=True,
                    use_non_blocking_copy=gpu,
                )
            )

    def prefix(self, step: int) -> str:
        return f"{self.row}/step-{step}"

    def start(self, step: int) -> tuple[float, float]:
        from concurrent.futures import Future

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from trainer_sidecar.checkpointer import build_state

        extra = {"step": step}
        if self.row == "ours":
            t0 = time.perf_counter()
            pending = self.ckpt.save(step, model=self.model, extra=extra)
            took = time.perf_counter() - t0
            self.stage_seconds.append(pending.stage_seconds)
            self._wait = pending.result
            return took, took
        writer = s3_writer(self.bucket, self.prefix(step))
        if self.row == "dcp_sync":
            t0 = time.perf_counter()
            dcp.save(build_state(self.model, None, extra), storage_writer=writer)
            took = time.perf_counter() - t0
            self._wait = lambda: None
            return took, took
        if self.row == "dcp_async_default":
            t0 = time.perf_counter()
            future = dcp.async_save(build_state(self.model, None, extra), storage_writer=writer)
            took = time.perf_counter() - t0
            assert isinstance(future, Future)  # no async_stager: a plain future
            self._wait = future.result
            return took, took
        assert self.row == "dcp_async_stager"
        t0 = time.perf_counter()
        response = dcp.async_save(
            build_state(self.model, None, extra), storage_writer=writer, async_stager=self.stager
        )
        returned = time.perf_counter() - t0
        assert isinstance(response, AsyncSaveResponse)  # with an async_stager
        response.staging_completion.result()
        safe = time.perf_counter() - t0
        self._wait = response.upload_completion.result
        return returned, safe

    def wait(self, step: int) -> None:
        import torch.distributed as dist

        self._wait()
        self._wait = lambda: None
        if self.row != "ours":
            dist.barrier()  # every rank's part written before it is deleted
            if dist.get_rank() == 0:
                delete_prefix(self.bucket, self.prefix(step))

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.stager is not None:
            self.stager.close()


def median_of_max(values: list[float]) -> tuple[float, list[float]]:
    """Per repeat the slowest rank, then the median over repeats."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    per_repeat = t.tolist()
    return statistics.median(per_repeat), per_repeat


def build_model_on_gpu(shape: StateShape) -> Any:
    """``build_model``'s module, allocated shard by shard on this rank's GPU."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(shape.rows, COLS))

    with torch.device("meta"):
        model = torch.nn.Sequential(*[Holder() for _ in range(shape.tensors)])
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=torch.device("cuda", torch.cuda.current_device()))
    return model


def floor_buffer(t: Any) -> Any:
    """The floor's destination: host memory like ``t`` (pinned when ``t`` is on a GPU)."""
    import torch

    if t.is_cuda:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return torch.empty_like(t)


def copy_floor(dst: list[Any], src: list[Any]) -> None:
    """The copy floor: every shard into its buffer; from a GPU non-blocking, then waited for."""
    import torch

    on_gpu = any(s.is_cuda for s in src)
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=on_gpu)
    if on_gpu:
        torch.cuda.current_stream().synchronize()


def run_stall(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    shape = StateShape(**args["shape"])
    row = args["row"]
    on_gpu = args.get("device", "cpu") == "cuda"
    model = build_model_on_gpu(shape) if on_gpu else build_model(shape)
    with torch.no_grad():
        for i, t in enumerate(local_shards(model)):
            gen = torch.Generator(device=t.device).manual_seed(i * 16 + dist.get_rank())
            t.normal_(generator=gen)
    shards = local_shards(model)
    state_bytes = sum(t.numel() * t.element_size() for t in shards)
    floor_dst = [floor_buffer(t) for t in shards]
    copy_floor(floor_dst, shards)  # touch the floor's buffers once
    saver = Saver(row, model, args)
    sampler = MemorySampler()
    sampler.resume()
    floors, returned, safe = [], [], []
    staged_pss = sampler.baseline
    try:
        for step in range(1 + args["repeats"]):
            warm = step == 0
            dist.barrier()
            sampler.pause()
            t0 = time.perf_counter()
            copy_floor(floor_dst, shards)
            floor = time.perf_counter() - t0
            dist.barrier()
            if warm:
                sampler.resume()  # the first save allocates: sample it throughout
            r, sf = saver.start(step)
            sampler.resume()
            if warm:
                staged_pss = sampler.peak  # what the first save holds once the loop is free
            saver.wait(step)
            time.sleep(SETTLE_S)  # rank 0's persister may still be housekeeping after a commit
            if not warm:
                floors.append(floor)
                returned.append(r)
                safe.append(sf)
        sampler.pause()
        staged_bytes = 0
        if saver.ckpt is not None:
            from trainer_sidecar.save.slots import rank_dir

            staged_bytes = dir_bytes(str(rank_dir(saver.ckpt.root, dist.get_rank())))
    finally:
        saver.close()
        sampler.stop()
    floor_s, floor_all = median_of_max(floors)
    returned_s, returned_all = median_of_max(returned)
    safe_s, safe_all = median_of_max(safe)
    extra = sampler.peak - sampler.baseline
    out = {
        "row": row,
        "returned_seconds": returned_s,
        "safe_seconds": safe_s,
        "floor_seconds": floor_s,
        "returned_per_repeat": returned_all,
        "safe_per_repeat": safe_all,
        "floor_per_repeat": floor_all,
        "state_bytes_per_rank": int(max_over_ranks(state_bytes)),
        "extra_memory_bytes": int(max_over_ranks(extra)),
        "extra_memory_ratio": max_over_ranks(extra / state_bytes),
        "extra_memory_at_return_bytes": int(max_over_ranks(staged_pss - sampler.baseline)),
        "staging_dir_bytes": int(max_over_ranks(staged_bytes)),
    }
    if saver.stage_seconds:
        out["stage_seconds"], _ = median_of_max(saver.stage_seconds[1:] or saver.stage_seconds)
    return out


# --------------------------------------------------------------------------- goodput


def build_mlp(shape: MlpShape) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(shape.layers):
        layers += [torch.nn.Linear(shape.hidden, shape.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def pin(pid: int, cores: list[int]) -> None:
    """Every thread of process ``pid`` onto ``cores``: affinity is per thread, and a
    process's threads started later inherit their creator's."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that just ended


def run_goodput(args: dict[str, Any]) -> dict[str, Any]:
    """Goodput rounds (module docstring). With ``placements`` (--placed) every round runs
    the variants once per placement, each process moved onto its cores first, and ours
    persists through a sidecar process (``sidecar_pid``); the result is then one goodput
    dict per placement."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainer_sidecar import CheckpointConfig, Checkpointer
    from trainer_sidecar.checkpointer import build_state
    from trainer_sidecar.format.manifest import Mode

    shape = MlpShape(**args["mlp"])
    model, opt = build_mlp(shape)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(shape.batch, shape.hidden, generator=gen)
    y = torch.randn(shape.batch, shape.hidden, generator=gen)

    def train_step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(3):  # warm-up; creates Adam's state
        train_step()
    state_bytes = sum(
        t.to_local().numel() * t.element_size()
        for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
        if hasattr(t, "to_local")
    )
    sidecar_pid, server_pid = args.get("sidecar_pid"), args.get("server_pid")
    ckpt = Checkpointer(
        CheckpointConfig(
            uri=args["goodput_uri"],  # each run its own steps
            mode=Mode.INCREMENTAL,
            keep_last=2,
            staging_dir=args["staging"],
            sidecar=sidecar_pid is not None,
        )
    )
    pending: list[Any] = []

    def save_ours(step: int) -> None:
        pending[:] = [ckpt.save(step, model=model, optimizer=opt, extra={"step": step})]

    def flush_ours() -> None:
        if pending:
            pending.pop().result()

    def save_sync(step: int) -> None:
        writer = s3_writer(args["bucket"], f"goodput-dcp/step-{step}")
        dcp.save(build_state(model, opt, {"step": step}), storage_writer=writer)

    variants: dict[str, tuple[Callable[[int], None] | None, Callable[[], None] | None]] = {
        "no_checkpoint": (None, None),
        "ours": (save_ours, flush_ours),
    }
    if sidecar_pid is None:  # DCP's saves run in the ranks: nothing to place apart
        variants["dcp_sync"] = (save_sync, None)
    placements: dict[str, dict[str, list[int]]] = args.get("placements") or {"": {}}
    totals = {(p, name): RunTotals() for p in placements for name in variants}

    def cpu_of(pid: int | None) -> float:
        return process_cpu_seconds(pid) if pid else 0.0

    def place(cores: dict[str, list[int]]) -> None:
        if not cores:
            return
        pin(os.getpid(), cores["ranks"])
        if dist.get_rank() == 0:
            for pid in (server_pid, sidecar_pid):
                if pid:
                    pin(pid, cores["checkpoint"])
        dist.barrier()

    step = 0

    def segment(save: Callable[[int], None] | None, stalls: list[float]) -> None:
        """``saves`` x K steps; a save (if any) after the first of each K, so its upload
        overlaps the other K - 1 (and, from the second save on, waits for the one before
        if that has not committed: our staging slot is single)."""
        nonlocal step
        for i in range(shape.every * shape.saves):
            step += 1
            train_step()
            if save is not None and i % shape.every == 0:
                t0 = time.perf_counter()
                save(step)
                stalls.append(time.perf_counter() - t0)

    try:
        save_ours(0)  # warm-up saves: our slot is allocated and touched, DCP's client made
        flush_ours()
        if "dcp_sync" in variants:
            save_sync(0)
        rounds = max(1, shape.steps // (shape.every * shape.saves))
        for r in range(rounds):
            for placement, cores in placements.items():
                place(cores)
                names = list(variants)
                for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated order
                    save, flush = variants[name]
                    t = totals[placement, name]
                    cpu, server_cpu, sidecar_cpu = (
                        process_cpu_seconds(), cpu_of(server_pid), cpu_of(sidecar_pid)
                    )  # fmt: skip
                    loop = timed(functools.partial(segment, save, t.stalls))[0]
                    flushed = timed(flush)[0] if flush is not None else 0.0
                    t.loop, t.flush = t.loop + loop, t.flush + flushed
                    t.rounds.append(loop + flushed)
                    t.cpu += process_cpu_seconds() - cpu
                    t.server_cpu += cpu_of(server_pid) - server_cpu
                    t.sidecar_cpu += cpu_of(sidecar_pid) - sidecar_cpu
                    t.saves += shape.saves if save is not None else 0
    finally:
        ckpt.close()
    steps = rounds * shape.every * shape.saves
    results: dict[str, dict[str, Any]] = {}
    for placement, cores in placements.items():
        out: dict[str, Any] = {
            "state_bytes_per_rank": int(max_over_ranks(state_bytes)),
            "rounds": rounds,
            "steps_per_run": steps,
        }
        if cores:
            out["cores"] = cores
        for name in variants:
            t = totals[placement, name]
            out[name] = {
                "loop_seconds": t.loop,
                "flush_seconds": t.flush,
                "total_seconds": t.loop + t.flush,
                "steps_per_second": steps / (t.loop + t.flush),
                "saves": t.saves,
                "stall_seconds_mean": max_over_ranks(statistics.mean(t.stalls))
                if t.stalls
                else 0.0,
                # CPU seconds: both rank processes together; the server and the sidecar
                # (the same figure on every rank)
                "trainer_cpu_seconds": over_ranks(t.cpu, "SUM"),
                "server_cpu_seconds": max_over_ranks(t.server_cpu),
                "sidecar_cpu_seconds": max_over_ranks(t.sidecar_cpu),
                "round_seconds": t.rounds,
            }
        results[placement] = out
    return results if args.get("placements") else results[""]


# --------------------------------------------------------------------------- processes


def worker_main(phase: str, args_path: str) -> None:
    phases = {"stall": run_stall, "goodput": run_goodput}
    bench_checkpoint.rank_main(
        {name: _with_engine(run) for name, run in phases.items()}, phase, args_path, backend
    )


def _with_engine(
    run: Callable[[dict[str, Any]], dict[str, Any]],
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda args: run(args) | {"engine": engine_info()}


def backend(phase: str, args: dict[str, Any]) -> str:
    """gloo on the CPU; for the stall from a GPU, each rank on GPU ``LOCAL_RANK mod count``,
    with NCCL beside gloo when every rank has one of its own (NCCL refuses a shared GPU)."""
    if phase != "stall" or args.get("device", "cpu") != "cuda":
        return "gloo"
    import torch

    count = torch.cuda.device_count()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % count)
    return "cpu:gloo,cuda:nccl" if count >= WORLD else "gloo"


def run_world(phase: str, args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One phase on WORLD rank processes; rank 0's result. A phase whose ranks crash is
    run once more before giving up: DCP's async_save anchor has been seen to abort a rank
    at exit ("terminate called without an active exception") on a loaded machine."""
    try:
        return _run_world_once(phase, args, env)
    except RuntimeError as exc:
        print(
            f"warning: {phase} ({args.get('row', '')}) failed, running it again:\n{exc}",
            file=sys.stderr,
        )
        return _run_world_once(phase, args, env)


def _run_world_once(phase: str, args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return bench_checkpoint.run_world(WORLD, phase, args, env, script=__file__)


# --------------------------------------------------------------------------- the report


def ratios(stall: dict[str, dict[str, Any]], goodput: dict[str, Any] | None) -> dict[str, float]:
    ours = stall["ours"]
    best = stall["dcp_async_stager"]
    values = {
        "stall_ratio_vs_floor": ours["returned_seconds"] / ours["floor_seconds"],
        "stall_ratio_vs_dcp_best": ours["returned_seconds"] / best["safe_seconds"],
        "stall_ratio_vs_dcp_best_returned": ours["returned_seconds"] / best["returned_seconds"],
        "stall_ratio_vs_dcp_async_default": ours["returned_seconds"]
        / stall["dcp_async_default"]["returned_seconds"],
        "stall_ratio_vs_dcp_sync": ours["returned_seconds"] / stall["dcp_sync"]["returned_seconds"],
        "dcp_best_stall_ratio_vs_floor": best["returned_seconds"] / ours["floor_seconds"],
        "extra_memory_ratio": ours["extra_memory_ratio"],
    }
    if goodput is None:  # --stall-only
        return values
    none = goodput["no_checkpoint"]["steps_per_second"]
    median, spread = goodput_by_round(goodput)
    return values | {
        "goodput_ratio_vs_no_checkpoint": median,
        "goodput_ratio_spread": spread,
        "goodput_ratio_vs_no_checkpoint_total": goodput_ratio(goodput),
        "dcp_sync_goodput_ratio_vs_no_checkpoint": goodput["dcp_sync"]["steps_per_second"] / none,
        "wallclock_reduction_vs_sync": wallclock_reduction(goodput),
    }


def goodput_by_round(goodput: dict[str, Any]) -> tuple[float, float]:
    """The median and the spread (max - min) of the goodput ratio round by round: each
    round ran every variant back to back (in rotated order), so a round's ratio compares
    runs that met the same machine, and the median resists the rounds that did not."""
    pairs = zip(
        goodput["no_checkpoint"]["round_seconds"], goodput["ours"]["round_seconds"], strict=True
    )
    per_round = [none / ours for none, ours in pairs]
    return statistics.median(per_round), max(per_round) - min(per_round)


def placed_ratios(where: str, g: dict[str, Any]) -> dict[str, float]:
    """--placed, one placement: the goodput ratio (median and spread by round, each of
    ours' segments charged its wait for the commit), the training loop's own ratio (the
    commit waits left out: the steady state when the checkpoint path keeps up, as a real
    loop never waits for a commit), and what the checkpoint path costs per save (the
    sidecar's and the server's CPU seconds) against the seconds between saves."""
    none, ours = g["no_checkpoint"], g["ours"]
    median, spread = goodput_by_round(g)
    saves = max(1, ours["saves"])
    return {
        f"goodput_ratio_{where}_vs_no_checkpoint": median,
        f"goodput_ratio_{where}_spread": spread,
        f"loop_ratio_{where}_vs_no_checkpoint": none["loop_seconds"] / ours["loop_seconds"],
        f"checkpoint_cpu_seconds_per_save_{where}": (
            ours["server_cpu_seconds"] + ours["sidecar_cpu_seconds"]
        )
        / saves,
        f"seconds_between_saves_{where}": ours["loop_seconds"] / saves,
    }


def goodput_ratio(goodput: dict[str, Any]) -> float:
    return float(goodput["ours"]["steps_per_second"] / goodput["no_checkpoint"]["steps_per_second"])


def wallclock_reduction(goodput: dict[str, Any]) -> float:
    return float(1 - goodput["ours"]["total_seconds"] / goodput["dcp_sync"]["total_seconds"])


def judge(values: dict[str, float]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (op, bound) in TARGETS.items():
        if name not in values:  # a phase not run
            continue
        v = values[name]
        out[name] = {
            "value": v,
            "target": f"{op} {bound}",
            "met": bool(v <= bound if op == "<=" else v >= bound),
        }
    return out


STALL_LABELS = {
    "floor": "floor: copy into touched buffers",
    "ours": "ours: Checkpointer.save",
    "dcp_sync": "DCP save (sync, S3StorageWriter)",
    "dcp_async_default": "DCP async_save, defaults",
    "dcp_async_stager": "DCP async_save, reused DefaultStager",
}


def table(report: dict[str, Any]) -> str:
    stall = report["stall"]
    floor = stall["ours"]["floor_seconds"]
    lines = [
        f"{'stall (slowest rank, median)':<40}{'returned s':>11}{'safe s':>9}"
        f"{'x floor':>9}{'extra mem':>11}",
        "-" * 80,
        f"{STALL_LABELS['floor']:<40}{floor:>11.3f}{floor:>9.3f}{1.0:>9.2f}{'':>11}",
    ]
    for row in STALL_ROWS:
        s = stall[row]
        lines.append(
            f"{STALL_LABELS[row]:<40}{s['returned_seconds']:>11.3f}{s['safe_seconds']:>9.3f}"
            f"{s['returned_seconds'] / floor:>9.2f}{s['extra_memory_ratio']:>10.2f}x"
        )
    every = report["config"]["mlp"]["every"]
    if report.get("goodput"):
        lines += goodput_table(report["goodput"], f"goodput, a save every {every} steps")
    if report.get("goodput_long"):
        long_every = report["config"]["long_every"]
        lines += goodput_table(report["goodput_long"], f"goodput, every {long_every} steps")
    for placement, g in (report.get("goodput_placed") or {}).items():
        cores = g["cores"]
        title = f"{placement} (ranks {cores['ranks']}, ckpt {cores['checkpoint']}), every {every}"
        lines += goodput_table(g, title)
    lines += ratio_lines(report, width=44)
    return "\n".join(lines)


def goodput_table(g: dict[str, Any], title: str) -> list[str]:
    lines = [
        "",
        f"{title:<30}{'loop s':>8}{'flush s':>8}{'total s':>8}{'steps/s':>8}"
        f"{'saves':>6}{'stall s':>8}{'cpu s':>7}{'server cpu s':>13}{'sidecar cpu s':>14}",
        "-" * 110,
    ]
    for name in ("no_checkpoint", "ours", "dcp_sync"):
        if name not in g:  # sidecar mode runs no DCP save
            continue
        r = g[name]
        lines.append(
            f"{name:<30}{r['loop_seconds']:>8.2f}{r['flush_seconds']:>8.2f}"
            f"{r['total_seconds']:>8.2f}{r['steps_per_second']:>8.2f}{r['saves']:>6}"
            f"{r['stall_seconds_mean']:>8.3f}{r['trainer_cpu_seconds']:>7.2f}"
            f"{r['server_cpu_seconds']:>13.2f}{r['sidecar_cpu_seconds']:>14.2f}"
        )
    return lines


@contextmanager
def cleanup(path: str) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def place_server(server_pid: int | None, server_cores: int | None) -> dict[str, Any]:
    """Give the S3 server cores of its own (the rank processes, started later, inherit the
    rest), as a remote S3 would not share the trainers' CPUs. ``server_cores`` None: half
    the cores on a machine with 4 or more, none (everything shares) on smaller ones."""
    cores = sorted(os.sched_getaffinity(0))
    if server_cores is None:
        server_cores = len(cores) // 2 if len(cores) >= 4 else 0
    if not server_pid or server_cores <= 0 or server_cores >= len(cores):
        return {"shared": cores}
    ranks, server = cores[:-server_cores], cores[-server_cores:]
    pin(server_pid, server)  # a Go server (SeaweedFS) has started its threads already
    os.sched_setaffinity(0, ranks)
    log(f"cores: ranks {ranks}, S3 server {server}")
    return {"ranks": ranks, "server": server}


def placements(train_cores: int | None) -> dict[str, dict[str, list[int]]]:
    """--placed: "pinned" puts the ranks on ``train_cores`` cores (default: half) and the
    checkpoint path (the sidecar and the S3 server) on the rest, as on a GPU node where
    training runs on the GPUs and the host's cores are free; "shared" gives everyone
    every core."""
    cores = sorted(os.sched_getaffinity(0))
    n = train_cores or len(cores) // 2
    if len(cores) < 2 or not 0 < n < len(cores):
        raise SystemExit(f"--placed needs 2+ cores and 0 < --train-cores < {len(cores)}")
    return {
        "pinned": {"ranks": cores[:n], "checkpoint": cores[n:]},
        "shared": {"ranks": cores, "checkpoint": cores},
    }


@contextmanager
def sidecar_process(uri: str, staging: str, env: dict[str, str]) -> Iterator[int]:
    """``ctj sidecar`` persisting what the ranks stage under ``staging`` to ``uri``; its pid.
    Its log goes to a temporary file, printed if it exits early."""
    log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below
        prefix="ctj-bench-sidecar-", suffix=".log", delete=False
    )
    cmd = [sys.executable, "-m", "trainer_sidecar", "sidecar", "--uri", uri,
           "--staging-dir", staging, "--grace", "60"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=dict(env, CTJ_CHECKPOINT_KEEP_LAST="2"), stdout=log_file, stderr=log_file
    )
    try:
        yield proc.pid
    finally:
        early = proc.poll()
        proc.terminate()
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()
        if early is not None:
            print(f"the sidecar exited early ({early}):", open(log_file.name).read()[-3000:],
                  file=sys.stderr)  # fmt: skip
        os.unlink(log_file.name)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    try:
        import s3torchconnector.dcp  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        raise SystemExit(
            f"s3torchconnector is needed for the DCP rows ({exc}); install: pip install "
            "--no-deps s3torchconnector==1.5.0 s3torchconnectorclient==1.5.0 tenacity==9.2.1"
        ) from None
    from trainer_sidecar.config import default_staging_root

    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available())")
    shape = StateShape.for_total(opts.total_mib * MIB, opts.tensors)
    mlp = MlpShape(opts.hidden, opts.layers, opts.batch, opts.steps, opts.every, opts.saves)
    started = time.monotonic()
    load_before = load_average()
    # a private staging root: test sessions on a shared machine clean up new job dirs under
    # the default one (tests/conftest.py), which would pull the slots from under this run
    staging = tempfile.mkdtemp(
        prefix="ctj-bench-async-", dir=os.path.dirname(default_staging_root())
    )
    with s3_server(opts.endpoint_url, opts.s3) as (endpoint, server, server_pid), cleanup(staging):
        placement = place_server(server_pid, opts.server_cores)
        env = project_env(endpoint)
        bucket = create_bucket(endpoint)
        args = {
            "shape": dataclasses.asdict(shape),
            "mlp": dataclasses.asdict(mlp),
            "uri": f"s3://{bucket}/ours",
            "bucket": bucket,
            "repeats": opts.repeats,
            "staging": staging,
            "server_pid": server_pid,
            "device": opts.device,
        }
        log(
            f"state: {shape.tensors} x ({shape.rows} x {COLS}) fp32 = "
            f"{shape.total_bytes / MIB:.0f} MiB over {WORLD} ranks on {opts.device}; "
            f"server: {server}"
        )
        stall: dict[str, dict[str, Any]] = {}
        engine: dict[str, Any] = {}
        for row in STALL_ROWS:
            log(f"stall: {row}")
            stall[row] = run_world("stall", dict(args, row=row), env)
            engine = stall[row].pop("engine")
        goodput, goodput_long, goodput_placed = None, None, None
        uri = f"{args['uri']}-goodput-every-{mlp.every}"
        if opts.placed and not opts.stall_only:
            cores = placements(opts.train_cores)
            log(f"goodput, sidecar mode, pinned {cores['pinned']} and shared: {mlp}")
            with sidecar_process(uri, staging, env) as sidecar_pid:
                goodput_placed = run_world("goodput", dict(
                    args, goodput_uri=uri, placements=cores, sidecar_pid=sidecar_pid
                ), env)  # fmt: skip
            goodput_placed.pop("engine")
        elif not opts.stall_only:
            log(f"goodput: {mlp}")
            goodput = run_world("goodput", dict(args, goodput_uri=uri), env)
            goodput.pop("engine")
        if opts.long_every and not opts.stall_only and not opts.placed:
            long = dataclasses.replace(
                mlp, every=opts.long_every, steps=2 * opts.long_every, saves=1
            )
            log(f"goodput at a longer interval: {long}")
            long_uri = f"{args['uri']}-goodput-every-{long.every}"
            goodput_long = run_world(
                "goodput", dict(args, mlp=dataclasses.asdict(long), goodput_uri=long_uri), env
            )
            goodput_long.pop("engine")
    values = ratios(stall, goodput)
    if goodput_placed is not None:
        for where, g in goodput_placed.items():
            values |= placed_ratios(where, g)
    if goodput_long is not None:  # reported beside the targets, not judged
        values["goodput_ratio_vs_no_checkpoint_long"] = goodput_by_round(goodput_long)[0]
        values["goodput_ratio_spread_long"] = goodput_by_round(goodput_long)[1]
        values["wallclock_reduction_vs_sync_long"] = wallclock_reduction(goodput_long)
    return {
        "command": " ".join(["python", "bench/bench_async.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": time.monotonic() - started,
        "load_average": {"before": load_before, "after": load_average()},
        "config": {
            "world_size": WORLD,
            "total_bytes": shape.total_bytes,
            "tensors": shape.tensors,
            "tensor_shape": [shape.rows, COLS],
            "repeats": opts.repeats,
            "mlp": dataclasses.asdict(mlp),
            "long_every": opts.long_every,
            "quick": opts.quick,
            "stall_device": opts.device,
            "placed": opts.placed,
        },
        "server": server,
        "engine": engine,
        "machine": machine(),
        "cpu_placement": placement,
        "stall": stall,
        "goodput": goodput,
        "goodput_long": goodput_long,
        "goodput_placed": goodput_placed,
        "ratios": values,
        "targets": judge(values),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures and ratios here")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--total-mib", type=int, default=1024, help="stall state (default 1024)")
    parser.add_argument("--tensors", type=int, default=20, help="tensors in the stall state")
    parser.add_argument("--repeats", type=int, default=5, help="timed saves per stall row")
    parser.add_argument("--hidden", type=int, default=1536, help="goodput MLP width")
    parser.add_argument("--layers", type=int, default=8, help="goodput MLP depth")
    parser.add_argument("--batch", type=int, default=32, help="goodput batch per rank")
    parser.add_argument("--steps", type=int, default=40, help="goodput steps per run")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every K steps")
    parser.add_argument(
        "--saves-per-segment",
        dest="saves",
        type=int,
        default=1,
        help="saves in each variant's turn of a round (K steps each); ours waits for its "
        "last commit once, at the turn's end, as a loop that saves every K steps would "
        "(default 1: a wait after every save)",
    )
    parser.add_argument(
        "--long-every",
        type=int,
        default=50,
        help="also run goodput at this longer interval, reported beside the targets (0: not)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the stall state lives (cuda: on the GPU, the floor a D2H copy into pinned "
        "memory); goodput stays on the CPU",
    )
    parser.add_argument("--stall-only", action="store_true", help="skip the goodput phases")
    parser.add_argument(
        "--placed",
        action="store_true",
        help="goodput in sidecar mode, each round both pinned (the ranks on --train-cores "
        "cores, the sidecar and the S3 server on the rest, as on a GPU node) and shared "
        "(every process on every core); replaces the in-process goodput phases",
    )
    parser.add_argument(
        "--train-cores", type=int, help="--placed: cores for the ranks (default: half)"
    )
    add_s3_arguments(parser)
    parser.add_argument(
        "--server-cores",
        type=int,
        help="cores reserved for the S3 server (default: half of them on 4+ cores, else 0)",
    )
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.total_mib, opts.tensors, opts.repeats = 32, 8, 2
        opts.hidden, opts.layers, opts.batch, opts.steps, opts.every = 256, 4, 16, 8, 4
        opts.long_every = 8
    return opts


def main(argv: list[str] | None = None) -> int:
    return bench_checkpoint.script_main(argv, parse_args=parse_args, run=run, table=table)


if __name__ == "__main__":
    sys.exit(main())
