"""Run a function on N real processes joined by torch.distributed (gloo, CPU).

Each rank is a process of its own with the environment torchrun would give it; the
target runs after init_process_group. A rank's assertion error fails the test with that
rank's output.

Ranks are forked (ctj_devcluster/forked.py) from one forkserver that has torch, DCP and
the engine imported (rank_preload.py): a fork costs milliseconds where a fresh
interpreter costs about 4 CPU-seconds of imports, and the integration tier starts some
hundred ranks. ``fresh=True`` runs ``python -m tests.integration.ranks`` instead, for a
test about the process itself (how it exits, what the interpreter does at its end).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any

from ctj_devcluster.forked import ForkedProcess, preload

from tests.conftest import ROOT, free_port
from trainer_sidecar.rank_exit import exit_rank

preload(["tests.integration.rank_preload"])


def _rank_env(rank: int, world_size: int, port: int, env: dict[str, str] | None) -> dict[str, str]:
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
    return rank_env


def spawn_ranks(
    world_size: int,
    target: str,
    args: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> list[ForkedProcess | subprocess.Popen[str]]:
    port = free_port()
    procs: list[ForkedProcess | subprocess.Popen[str]] = []
    for rank in range(world_size):
        rank_env = _rank_env(rank, world_size, port, env)
        if not fresh:
            procs.append(ForkedProcess(run_target, (target, json.dumps(args)), rank_env))
            continue
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
    fresh: bool = False,
) -> list[str]:
    """Run target on every rank; returns each rank's output, raises if any rank failed."""
    procs = spawn_ranks(world_size, target, args, env=env, fresh=fresh)
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


def run_target(target: str, raw: str) -> None:
    """In a rank: ``target(args)`` inside the process group, then exit as a trainer does."""
    import torch.distributed as dist

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
    run_target(sys.argv[1], sys.argv[2])
