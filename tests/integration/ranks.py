"""Run a function on N real processes joined by torch.distributed (gloo, CPU).

Each rank is a fresh ``python -m tests.integration.ranks`` process with the
environment torchrun would give it; the target runs after init_process_group.
A rank's assertion error fails the test with that rank's output.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any

from tests.conftest import ROOT, free_port
from trainer_sidecar.rank_exit import exit_rank


def spawn_ranks(
    world_size: int, target: str, args: dict[str, Any], *, env: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ, **(env or {}))
        rank_env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=ROOT,
            # a rank that aborts (SIGABRT: "terminate called ...") prints every thread's
            # Python stack: which thread was still running
            PYTHONFAULTHANDLER="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.integration.ranks", target, json.dumps(args)],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
            )
        )
    return procs


def run_ranks(
    world_size: int,
    target: str,
    args: dict[str, Any],
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run target on every rank; returns each rank's output, raises if any rank failed."""
    procs = spawn_ranks(world_size, target, args, env=env)
    outputs = []
    failed = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            failed.append(rank)
        outputs.append(out)
        if proc.returncode != 0:
            failed.append(rank)
    if failed:
        details = "\n".join(f"--- rank {r} ---\n{outputs[r][-4000:]}" for r in sorted(set(failed)))
        raise AssertionError(f"{target} failed on ranks {sorted(set(failed))}:\n{details}")
    return outputs


def _main() -> None:
    import torch.distributed as dist

    target, raw = sys.argv[1], sys.argv[2]
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if "WORLD_SIZE" not in os.environ:  # a single plain process
        fn(json.loads(raw))
        return
    dist.init_process_group("gloo")
    try:
        fn(json.loads(raw))
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank(0)  # as a trainer ends (trainer_sidecar/rank_exit.py: why)


if __name__ == "__main__":
    _main()
