"""Rank processes forked from one preloaded forkserver, for the tests and the benchmarks.

A fresh rank process spends about 4 CPU-seconds importing torch, DCP, FSDP2 and the
engine before its first line of work; the integration tier and a benchmark's smoke run
start some hundred of them. Forked from a server that has those imports done, a rank
costs milliseconds. The caller names what the server imports (``preload``, once per
process: multiprocessing keeps one forkserver per process) and each process's
environment, which replaces the server's.

The server must stay single-threaded for its forks to be safe (a BLAS or OpenMP pool
started at import is copied without its threads), so it starts with
``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` at 1, whatever the
caller's are; each child sets its own count after the fork.
What a fork does not give a child is said where it matters: the benchmarks' memory
figures (Pss) see the preloaded pages shared with the server and its other children.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

_FORK = multiprocessing.get_context("forkserver")
"""The context every ForkedProcess comes from (one forkserver per process)."""

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def preload(modules: list[str]) -> None:
    """What the forkserver imports before its first fork; call before the first start."""
    _FORK.set_forkserver_preload(modules)


@functools.cache
def _start_server() -> None:
    """The forkserver, started once with one thread per pool: it inherits this process's
    environment when it starts, so the thread variables are 1 for that moment only (once:
    another thread starting a process of its own meanwhile would inherit them too)."""
    saved = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    os.environ.update(dict.fromkeys(THREAD_VARIABLES, "1"))
    try:
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@functools.cache
def _logs() -> str:
    """The directory of this process's children's logs, removed at its exit (a child a
    caller killed and never read leaves its log there)."""
    path = tempfile.mkdtemp(prefix="ctj-forked-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class ForkedProcess:
    """``main(*args)`` in a process forked from the forkserver with exactly ``env`` as its
    environment and ``cores`` as its CPU affinity (default: the caller's now, as a child
    started here would inherit); stdout and stderr go to ``log`` (default: a file of its
    own, removed once ``communicate`` has returned it). The methods a test or a benchmark
    uses of ``subprocess.Popen``."""

    def __init__(
        self,
        main: Callable[..., None],
        args: Iterable[Any],
        env: dict[str, str],
        *,
        cores: Iterable[int] | None = None,
        log: Path | None = None,
    ) -> None:
        self._own_log = log is None
        if log is None:
            fd, path = tempfile.mkstemp(prefix="rank-", suffix=".log", dir=_logs())
            os.close(fd)
            log = Path(path)
        self._log = log
        affinity = sorted(os.sched_getaffinity(0) if cores is None else cores)
        _start_server()
        self._proc = _FORK.Process(
            target=_forked_main, args=(env, str(log), affinity, main, tuple(args)), daemon=True
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
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        out = self._log.read_text(errors="replace")
        if self._own_log:
            self._log.unlink(missing_ok=True)
        return out, None


def _become(env: dict[str, str], log: str, cores: list[int]) -> None:
    """In a process just forked from the forkserver: the environment (replaced, not merged), output,
    affinity and thread count a fresh process started with ``env`` would have."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.sched_setaffinity(0, cores)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, when a caller hangs
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))


def _forked_main(
    env: dict[str, str], log: str, cores: list[int], main: Callable[..., None], args: tuple
) -> None:
    """A ForkedProcess: _become, then ``main(*args)``. Ends the process itself, 1 on an
    exception, as an interpreter would, without its teardown (torch's gloo threads may be
    about: trainer_sidecar/rank_exit.py)."""
    _become(env, log, cores)
    code = 0
    try:
        main(*args)
    except SystemExit as exc:  # sys.exit(n): n, as the interpreter would
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
