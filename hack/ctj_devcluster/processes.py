"""Child processes that cannot outlive the cluster that started them.

A test cluster is half a dozen long-running servers plus whatever the simulated nodes run.
If any of them survives its test session it holds ports and CPU and confuses the next run,
so every process started here gets three guarantees:

- its own process group (``start_new_session``), so stopping it reaches its children too;
- ``PR_SET_PDEATHSIG(SIGKILL)``: if the process that started it dies, even by ``kill -9``,
  the kernel kills it. (The signal fires when the *thread* that forked it exits, so start
  processes from a thread that lives as long as they should: the main thread, or a
  long-lived worker.)
- ``stop()`` sends SIGTERM to the group, waits, then SIGKILLs the group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


class ProcessDied(RuntimeError):
    """A server exited while it should be running; the message holds its log tail."""


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when its parent dies. Async-signal-safe enough:
    one syscall, no allocation beyond what ctypes already holds."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def wait_until(
    predicate: Callable[[], object],
    *,
    timeout: float,
    what: str,
    interval: float = 0.1,
    on_timeout: Callable[[], str] | None = None,
) -> object:
    """Polls ``predicate`` until it returns something truthy; raises TimeoutError after
    ``timeout`` seconds naming ``what`` (plus ``on_timeout()``'s diagnostics)."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except ProcessDied:
            raise
        except Exception as exc:  # reported if the deadline passes
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            extra = f"\n{on_timeout()}" if on_timeout else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}{extra}")
        time.sleep(interval)


@dataclass
class ManagedProcess:
    """One server process, its output appended to ``log_path``."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)
    log_start: int = field(default=0, init=False)
    """Where the latest start's output begins in ``log_path`` (the log is appended to)."""

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"{self.name}: empty argv")

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_start = os.fstat(log.fileno()).st_size
            self.popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        return self

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} not started")
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"[{self.name}: no log]"
        return f"[{self.name} log: {self.log_path}]\n" + "\n".join(text[-lines:])

    def wait_ready(self, url: str, timeout: float) -> None:
        """Until ``url`` (its readiness endpoint) answers 200; raises ProcessDied with the
        log's tail if it exits first, TimeoutError if the deadline passes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.2)

    def check_alive(self) -> None:
        """Raises with the log tail if the process has exited (a server should not)."""
        if self.popen is not None and self.popen.poll() is not None:
            raise ProcessDied(f"{self.name} exited with {self.popen.returncode}\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole group at once: what losing a machine looks like."""
        self._signal_group(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the group, wait up to ``grace`` seconds, then SIGKILL it."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # The leader may be gone while children of the group remain: kill those too.
        self._signal_group(signal.SIGKILL)
        self.popen.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.popen is not None:
            signal_tree(self.popen.pid, sig)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first (Linux's /proc/<pid>/task/*/children)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # ended meanwhile
                continue
            found += children
            todo += children
    return found


def signal_tree(leader: int, sig: signal.Signals) -> None:
    """``sig`` to ``leader``'s process group and, for SIGKILL, to every process below it
    in any group or session (a process that started a session of its own, such as the ctj
    launcher's worker, would outlive its "machine" or "container" otherwise: a kubelet's
    runtime kills the whole cgroup). Collected before the group dies (orphans are
    reparented out of reach)."""
    below = descendants(leader) if sig == signal.SIGKILL else []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, sig)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
