"""Run a function on N real processes joined by torch.distributed (gloo, CPU).

Each rank is a process of its own with the environment torchrun would give it; the
target runs after init_process_group. A rank's assertion error fails the test with that
rank's output.

The ranks are forked from a forkserver that has imported torch, DCP, FSDP and the
engine once per test session (``FORK``; the chaos test's ranks use it too): a rank
costs a fork instead of ~4 CPU-seconds of imports, which on 2 cores was about a fifth
of the integration tier. What a rank runs is what a fresh ``python`` would run: its own
environment (replaced, not merged), output, process group and exit (rank_exit).
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from multiprocessing.process import BaseProcess
from typing import Any

# what every rank imports, imported once, in the forkserver (FSDP2 imports torch._dynamo:
# ~2 s of the ~4)
import torch
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401

import trainer_sidecar.checkpointer  # noqa: F401
import trainer_sidecar.load.restore  # noqa: F401
from tests.conftest import ROOT, free_port
from trainer_sidecar.rank_exit import exit_rank

FORK = multiprocessing.get_context("forkserver")
FORK.set_forkserver_preload(
    ["tests.integration.ranks", "tests.integration.workers", "tests.integration.chaos_worker"]
)


class RankProcess:
    """A forked rank, with the part of ``subprocess.Popen``'s interface the tests use;
    its output (stdout and stderr) goes to a file, read back by ``communicate``."""

    def __init__(self, env: dict[str, str], target: str, args: dict[str, Any]) -> None:
        fd, self._log = tempfile.mkstemp(prefix="ctj-rank-", suffix=".log")
        os.close(fd)
        self._proc: BaseProcess = FORK.Process(
            target=_rank_main, args=(env, self._log, target, args), daemon=True
        )
        self._proc.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """As Popen's: the exit status, or minus the signal that ended it."""
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0)
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for the rank to end; its whole output (the log is then removed)."""
        self.wait(timeout)
        try:
            with open(self._log, errors="replace") as f:
                return f.read(), None
        finally:
            os.unlink(self._log)

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None and self._proc.pid is not None:
            os.kill(self._proc.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn_ranks(
    world_size: int, target: str, args: dict[str, Any], *, env: dict[str, str] | None = None
) -> list[RankProcess]:
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
        )
        procs.append(RankProcess(rank_env, target, args))
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


def become_rank(env: dict[str, str], log: str) -> None:
    """In a process just forked from FORK: make it what a fresh rank process would be,
    with ``env`` as its whole environment and its output (stdout, stderr) in ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    # a rank that aborts (SIGABRT: "terminate called ...") prints every thread's Python
    # stack: which thread was still running
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 was read when torch was imported


def _rank_main(env: dict[str, str], log: str, target: str, args: dict[str, Any]) -> None:
    """A forked rank: its environment and output, then ``target(args)`` in the group."""
    become_rank(env, log)
    module, _, name = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
        dist.init_process_group("gloo")
        fn(args)
    except BaseException:
        traceback.print_exc()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stderr.flush()
        os._exit(1)
    exit_rank(0)  # as a trainer ends (trainer_sidecar/rank_exit.py: why)


def _main() -> None:
    """``python -m tests.integration.ranks module:function '<json>'``: the target in this
    process (a test that signals or kills its rank from outside starts one so), in a
    group when WORLD_SIZE is set."""
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
    exit_rank(0)


if __name__ == "__main__":
    _main()
