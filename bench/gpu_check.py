"""The device path on a real GPU (issue 9): a couple of minutes on one or two GPUs.

    source hack/env.sh
    python bench/gpu_check.py              # 1 process; then 2 ranks on NCCL if 2 GPUs exist
    python bench/gpu_check.py --mib 512    # a larger state
    python bench/gpu_check.py --cpu        # a dry run of the script itself on gloo/CPU

Nothing here runs in CI (no GPU there): tests/unit/test_device.py checks the device
choice and the CPU path; this is for a person with a GPU. Each case runs in fresh rank
processes, stores to ``file://`` in a temporary directory, saves an FSDP2-sharded state
(fp32, fp16 and bf16 tensors, odd sizes: some copies go to unaligned offsets) from CUDA
and checks:

* save-waits-for-copy: every GPU copy is queued behind a GPU spin (``torch.cuda._sleep``),
  so a save that returned before its copies landed would leave the slot stale; right after
  ``save`` returns, the slot's bytes are compared (as a byte histogram, layout-free) with
  the tensors' at save time, and the tensors are then overwritten from a side stream (not
  ordered after the copies), so a save that did not wait stages the new values.
* slot-pinned: the slot's mapping was registered with CUDA (cudaHostRegister) once, and
  CUDA sees its memory as pinned.
* load-bitwise: a fresh model on CUDA loads each checkpoint bitwise equal to the values
  at its save time (the first save plans through DCP, the second reuses the layout).
* collectives on NCCL (2 ranks): the collectives' device is the rank's GPU; any_rank,
  gather_all and decided_by_rank0 work on an NCCL-only group; Checkpointer's
  preemption_requested gives every rank the flag one rank raised.

Prints a PASS/FAIL table and exits 1 if any check failed (2 without a CUDA device).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
SPIN_CYCLES = 50_000_000  # per copy: ~25 ms at 2 GHz, so a state's copies trail by >0.1 s
RANK_TIMEOUT_S = 240
DTYPES = ("float32", "float16", "float32", "bfloat16", "float32", "float32")
COLS = 1023  # odd: 2-byte tensors of odd rows end at offsets that are not 4-aligned

Check = tuple[str, str, str]  # (name, PASS | FAIL | SKIP, detail)


# --------------------------------------------------------------------------- rank side


def build(rows: int, device: Any, seed: int | None) -> Any:
    """One FSDP2-sharded parameter per dtype in DTYPES; random (seeded per rank) or zeros."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Holder(torch.nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(rows, COLS, dtype=dtype))

    with torch.device("meta"):
        model = torch.nn.Sequential(*[Holder(getattr(torch, d)) for d in DTYPES])
    if dist.is_initialized():
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for i, t in enumerate(tensors(model)):
            if seed is None:
                t.zero_()
            else:
                gen = torch.Generator(device=device).manual_seed(seed * 100 + i * 16 + rank())
                t.copy_(torch.randn(t.shape, generator=gen, device=device))
    return model


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def tensors(model: Any) -> list[Any]:
    """This rank's tensors: the local shards of the parameters."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


def histogram(ts: list[Any]) -> Any:
    """How often each byte value occurs in the tensors: equal for any layout of the bytes."""
    import torch

    total = torch.zeros(256, dtype=torch.int64)
    for t in ts:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        total += torch.bincount(raw, minlength=256).cpu()
    return total


def slot_mappings() -> list[Any]:
    """This rank's staged tensor files, as the staging module keeps them mapped."""
    from trainer_sidecar.save import staging

    name = f"__{rank()}_0.distcp"
    return [m for p, m in list(staging._MAPS.items()) if p.name == name and m.tensor is not None]


def spin_before_gpu_copies() -> list[int]:
    """Queue each GPU copy of a save behind a GPU spin on its stream; returns the list of
    pin registrations (their sizes) it also starts recording."""
    import torch

    from trainer_sidecar.save import device, staging

    copy, register = staging._copy_into, device.register
    registered: list[int] = []

    def slow_copy(dst: Any, src: Any, *, non_blocking: bool = False) -> None:
        if src.is_cuda:
            torch.cuda._sleep(SPIN_CYCLES)
        copy(dst, src, non_blocking=non_blocking)

    def recorded(ptr: int, size: int) -> bool:
        ok = register(ptr, size)
        registered.append(size if ok else -size)
        return ok

    staging._copy_into = slow_copy
    device.register = recorded
    return registered


def check_rank(args: dict[str, Any]) -> list[Check]:
    import torch
    import torch.distributed as dist

    from trainer_sidecar import CheckpointConfig, Checkpointer

    gpu = args["device"] == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = max(3, args["mib"] * MIB // (len(DTYPES) * COLS * 4)) | 1
    out: list[Check] = []

    def record(name: str, ok: bool, detail: str = "") -> None:
        out.append((name, "PASS" if ok else "FAIL", detail))

    if gpu:
        record("device", True, f"{dev}: {torch.cuda.get_device_name(dev)}")
    registered = spin_before_gpu_copies()
    model = build(rows, dev, seed=1)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors(model))
    config = CheckpointConfig(uri=args["uri"], staging_dir=args["staging"], staging_slots=1)
    ckpt = Checkpointer(config)
    side = torch.cuda.Stream() if gpu else None
    paths: set[Path] = set()
    try:
        for step in (1, 2):  # the first save plans (DCP), the second reuses the layout
            want = [t.detach().clone() for t in tensors(model)]
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            pending = ckpt.save(step, model=model, extra={"step": step})
            took = time.perf_counter() - t0
            # right away, before anything waits on the GPU: the slot must hold the bytes
            mappings = slot_mappings()
            staged = histogram([m.tensor for m in mappings])
            overwrite(model, side)  # not ordered after the copies: a save that did not wait
            record(  # ... stages these values instead
                f"save {step} returned after its copies landed",
                len(mappings) == 1 and torch.equal(staged, histogram(want)),
                f"{state_bytes / MIB:.0f} MiB in {took:.3f}s; {len(mappings)} slot file(s)",
            )
            if gpu:
                paths.update(m.path for m in mappings)
                pinned = bool(mappings) and all(m.pinned for m in mappings)
                seen = bool(mappings) and bool(mappings[0].tensor.is_pinned())
                once = len(registered) == len(paths) and all(n > 0 for n in registered)
                record(
                    f"save {step}: slot pinned (cudaHostRegister, once per mapping)",
                    pinned and seen and once,
                    f"registrations {registered}, CUDA sees it pinned: {seen}",
                )
            assert pending is not None
            pending.result(timeout=120)
            loaded = build(rows, dev, seed=None)
            result = ckpt.load(model=loaded, step=step)
            got = tensors(loaded)
            equal = len(got) == len(want) and all(
                g.device == w.device and g.dtype == w.dtype and torch.equal(raw(g), raw(w))
                for g, w in zip(got, want, strict=True)
            )
            record(
                f"load {step} onto {dev.type}: bitwise equal to save time",
                result is not None and result.step == step and equal,
                f"step {getattr(result, 'step', None)}, {len(got)} tensors on {got[0].device}",
            )
        if world > 1:
            out += check_collectives(ckpt, dev)
    finally:
        ckpt.close()
    return out


def overwrite(model: Any, stream: Any) -> None:
    import torch

    with torch.no_grad():
        if stream is None:
            for t in tensors(model):
                t.add_(1)
            return
        with torch.cuda.stream(stream):
            for t in tensors(model):
                t.add_(1)
        stream.synchronize()


def raw(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_collectives(ckpt: Any, dev: Any) -> list[Check]:
    """On the group the rank processes share (NCCL-only with --device cuda)."""
    import torch.distributed as dist

    from trainer_sidecar import collectives

    out: list[Check] = []
    r = dist.get_rank()

    def attempt(name: str, fn: Any, want: Any) -> None:
        try:
            got = fn()
        except Exception as exc:  # noqa: BLE001 - a row of the table
            out.append((name, "FAIL", f"{type(exc).__name__}: {str(exc)[:160]}"))
            return
        out.append((name, "PASS" if got == want else "FAIL", f"got {got!r}, want {want!r}"))

    backend = dist.get_backend()
    attempt(f"collectives.device on {backend}", lambda: collectives.device(), dev)
    attempt("any_rank: nobody", lambda: collectives.any_rank(False), False)
    attempt("any_rank: rank 1 only", lambda: collectives.any_rank(r == 1), True)
    attempt("gather_all", lambda: collectives.gather_all(r), list(range(dist.get_world_size())))
    attempt("decided_by_rank0", lambda: collectives.decided_by_rank0(lambda: ("r", r)), ("r", 0))
    attempt("preemption_requested: none", ckpt.preemption_requested, False)
    ckpt._preempted = r == 1  # what handle_sigterm's handler sets on the rank signalled
    attempt("preemption_requested: rank 1 signalled", ckpt.preemption_requested, True)
    ckpt._preempted = False
    return out


def worker(args_path: str) -> None:
    import torch
    import torch.distributed as dist

    with open(args_path) as f:
        args = json.load(f)
    multi = "WORLD_SIZE" in os.environ
    if args["device"] == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)  # as every NCCL program must, before its first collective
        if multi:
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    elif multi:
        dist.init_process_group("gloo")
    try:
        checks = check_rank(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(args["out"] + f".{rank_env()}", "w") as f:
        json.dump(checks, f)


def rank_env() -> int:
    return int(os.environ.get("RANK", "0"))


# --------------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(name: str, world: int, opts: argparse.Namespace, tmp: Path) -> list[Check]:
    """One case on ``world`` fresh rank processes (none: a plain process); its rows."""
    case = tmp / name
    case.mkdir()
    args = {
        "device": "cpu" if opts.cpu else "cuda",
        "mib": opts.mib,
        "uri": f"file://{case / 'store'}",
        "staging": str(case / "staging"),
        "out": str(case / "checks.json"),
    }
    args_path = case / "args.json"
    args_path.write_text(json.dumps(args))
    paths = filter(None, [ROOT, os.environ.get("PYTHONPATH")])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a plain process unless this case makes ranks
    port = str(free_port())
    procs = []
    for r in range(world):
        rank_env = dict(env)
        if world > 1:
            rank_env.update(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", str(args_path)],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    rows: list[Check] = []
    deadline = time.monotonic() + RANK_TIMEOUT_S
    for r, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            output, _ = proc.communicate()
            rows.append((f"rank {r} finished within {RANK_TIMEOUT_S}s", "FAIL", "killed"))
        clean = proc.returncode == 0 and "terminate called" not in output
        rows.append(
            (f"rank {r} exited cleanly", "PASS" if clean else "FAIL", f"rc {proc.returncode}")
        )
        if not clean or opts.verbose:
            print(
                f"--- {name}, rank {r} (rc {proc.returncode}) ---\n{output[-4000:]}",
                file=sys.stderr,
            )
        path = Path(f"{args['out']}.{r}")
        if path.exists():
            rows += [
                (f"rank {r}: {c}", status, detail)
                for c, status, detail in json.loads(path.read_text())
            ]
        elif r == 0 or world > 1:
            rows.append((f"rank {r} reported its checks", "FAIL", "no report (see its output)"))
    return rows


def table(results: dict[str, list[Check]]) -> str:
    lines = [f"{'case':<16}{'check':<58}{'':<6}detail", "-" * 110]
    for case, rows in results.items():
        for check, status, detail in rows:
            lines.append(f"{case:<16}{check:<58}{status:<6}{detail}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="state per case (default 128)")
    parser.add_argument(
        "--world",
        type=int,
        choices=(1, 2),
        help="ranks of the multi-rank case (default: 2 "
        "when 2 GPUs exist, else only the single process)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="a dry run of this script on the CPU (gloo, 2 ranks): the GPU checks are skipped",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print every rank's output")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1])
        return 0
    opts = parse_args(argv)
    import torch

    gpus = 0 if opts.cpu else torch.cuda.device_count()
    if not opts.cpu and gpus == 0:
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False): run it on a "
            "machine with a GPU, or --cpu for a dry run of the script",
            file=sys.stderr,
        )
        return 2
    world = opts.world or (2 if opts.cpu or gpus >= 2 else 1)
    if world == 2 and not opts.cpu and gpus < 2:
        print(
            f"gpu_check: --world 2 needs 2 GPUs (NCCL refuses a shared one); {gpus} here",
            file=sys.stderr,
        )
        return 2
    label = "cpu (dry run)" if opts.cpu else f"{gpus} GPU(s)"
    print(
        f"gpu_check: torch {torch.__version__}, {label}, {opts.mib} MiB per case", file=sys.stderr
    )
    results: dict[str, list[Check]] = {}
    with tempfile.TemporaryDirectory(prefix="ctj-gpu-check-") as tmp:
        results["1 process"] = run_case("single", 1, opts, Path(tmp))
        if world == 2:
            backend = "gloo" if opts.cpu else "nccl"
            results[f"2 ranks, {backend}"] = run_case(backend, 2, opts, Path(tmp))
    print(table(results))
    failed = sum(status == "FAIL" for rows in results.values() for _, status, _ in rows)
    print(
        f"\n{'FAIL' if failed else 'PASS'}: {failed} check(s) failed"
        if failed
        else "\nPASS: every check passed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
