"""Run a function on N real processes joined by torch.distributed (gloo, CPU).

Each rank is a process of its own with the environment torchrun would give it; the
target runs after init_process_group. A rank's assertion error fails the test with that
rank's output.

Ranks are forked from one forkserver that has torch, DCP and the engine imported
(tests/integration/rank_preload.py): a fork costs milliseconds where a fresh
interpreter costs about 4 CPU-seconds of imports, and the integration tier starts some
hundred ranks. ``fresh=True`` runs ``python -m tests.integration.ranks`` instead, for a
test about the process itself (how it exits, what the interpreter does at its end).
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import importlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, free_port
from trainer_sidecar.rank_exit import exit_rank

FORK = multiprocessing.get_context("forkserver")
FORK.set_forkserver_preload(["tests.integration.rank_preload"])
"""The forkserver every forked rank of the tier comes from (test_chaos.py's too)."""


@functools.cache
def _logs() -> str:
    """The directory of this process's rank logs, removed at its exit (a rank a test
    killed and never read leaves its log there)."""
    path = tempfile.mkdtemp(prefix="ctj-ranks-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class ForkedRank:
    """A rank forked from FORK, its stdout and stderr in a file read back at the end."""

    def __init__(self, env: dict[str, str], target: str, args: dict[str, Any]) -> None:
        fd, path = tempfile.mkstemp(prefix="rank-", suffix=".log", dir=_logs())
        os.close(fd)
        self._log = Path(path)
        self._proc = FORK.Process(
            target=forked_main, args=(env, path, target, json.dumps(args)), daemon=True
        )
        self._proc.start()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode  # as Popen's: -N for a signal

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        out = self._log.read_text(errors="replace")
        self._log.unlink(missing_ok=True)
        return out, None


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
) -> list[ForkedRank | subprocess.Popen[str]]:
    port = free_port()
    procs: list[ForkedRank | subprocess.Popen[str]] = []
    for rank in range(world_size):
        rank_env = _rank_env(rank, world_size, port, env)
        if not fresh:
            procs.append(ForkedRank(rank_env, target, args))
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


def become_rank(env: dict[str, str], log: str) -> None:
    """In a process just forked from FORK: the environment, output and thread count a
    fresh rank process would have (``env`` replaces the forkserver's, not merged)."""
    import torch

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, when a test hangs
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))


def forked_main(env: dict[str, str], log: str, target: str, raw: str) -> None:
    """A forked rank: become_rank, then run_target. Ends the process itself, 1 on an
    exception, as an interpreter would."""
    import traceback

    become_rank(env, log)
    code = 0
    try:
        run_target(target, raw)
    except SystemExit as exc:  # sys.exit(n) in a target: n, as the interpreter would
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown, as exit_rank: torch's gloo threads may be about


if __name__ == "__main__":
    run_target(sys.argv[1], sys.argv[2])
