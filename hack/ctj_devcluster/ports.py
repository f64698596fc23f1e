"""Servers on ports nobody can take from under them.

Choosing a port by binding port 0, closing it and handing the number to a server leaves a
window in which anything else may bind it (another test's server, or simply an outgoing
connection: they draw their local port from the same ephemeral range). So:

- our own Python servers bind port 0 themselves, or are handed a socket we already bound
  (moto: see local_s3), and report the port they got: no window at all;
- a server we cannot hand a socket to (etcd and the Kubernetes binaries, the operator) is
  started with :func:`retry_on_bind_conflict`: it picks ports, launches the server, and
  returns once the server's *own* process holds a listening socket on each of them (read
  from /proc, so a stranger answering on that port is never mistaken for it). If the
  server instead exits, or logs "address already in use", it is stopped and started again
  on new ports, a bounded number of times, with a log line each time;
- :func:`free_port` picks below the kernel's ephemeral range when there is room, so
  outgoing connections never take the number meanwhile, and the retry is rarely needed.

Why not hold the port (bind it with SO_REUSEADDR, keep it until the server listens)? On
Linux that does keep bind(0) and connect() away from it, but another caller that already
chose the same number can still bind it explicitly, and a server that does not set
SO_REUSEADDR itself could never bind it at all: detecting and retrying covers both.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from .processes import ManagedProcess, ProcessDied

log = logging.getLogger("ctj_devcluster.ports")

BIND_CONFLICT = re.compile(rb"address already in use", re.IGNORECASE)
"""What Go ("bind: address already in use") and Python ("[Errno 98] Address already in
use") servers say when the port was taken."""

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
_LOW_PORT = 10000
RENDEZVOUS_PORTS = range(29400, 30500)
"""Never handed out by :func:`free_port`: ctj's operator gives each attempt's rank 0 a
rendezvous port in 29500-30499 (``ctj_operator.builders.master_port``), torchrun's default
is 29400, and torch's TCPStore binds them on every address. The simulated nodes' pods share
this host's network namespace, so a test's server there (or a test rank's store, beside
the cluster tier) would fail the rank 0 of a job in the cluster tier, or be failed by it."""

T = TypeVar("T", ManagedProcess, "subprocess.Popen[Any]")


class BindConflict(RuntimeError):
    """A server lost every port race it was given (``attempts`` of them)."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    """Whether ``port`` is free on every IPv4 address (a wildcard bind conflicts with a
    socket bound to the port on any address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on every IPv4 address a moment ago, for a server to bind.

    Still a race (use :func:`retry_on_bind_conflict` to start a server on it), but a small
    one: it is drawn at random from below the kernel's ephemeral range when there is room,
    so outgoing connections and bind(0) callers, the usual thieves, never get it; and
    never from :data:`RENDEZVOUS_PORTS`."""
    high = _ephemeral_low()
    if high - _LOW_PORT >= 1000:
        for _ in range(50):
            port = _LOW_PORT + secrets.randbelow(high - _LOW_PORT)
            if port not in RENDEZVOUS_PORTS and _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening_ports(pid: int) -> set[int]:
    """The TCP ports the process ``pid`` itself listens on (its own sockets, any
    address, IPv4 or IPv6); empty if it is gone."""
    fd_dir = f"/proc/{pid}/fd"
    inodes: set[str] = set()
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return set()
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _popen(proc: ManagedProcess | subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    if isinstance(proc, ManagedProcess):
        if proc.popen is None:
            raise RuntimeError(f"{proc.name}: launch returned a process it did not start")
        return proc.popen
    return proc


def _stop(proc: ManagedProcess | subprocess.Popen[Any]) -> None:
    if isinstance(proc, ManagedProcess):
        proc.stop(grace=2.0)
        return
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class ServerStart(Generic[T]):
    """A server started on chosen ports, in two steps: ``start()`` launches it (returns at
    once, so several can start together), ``wait_bound()`` returns the process and its
    ports once it listens on all of them, restarting it on new ports when it lost one.

    ``launch(ports)`` starts the server on ``ports`` and returns its ManagedProcess (its
    log is read from where it started) or Popen (give ``log``, the file its stderr is
    appended to; without one, a bind conflict is recognized by the port being taken when
    it exited). The process must itself listen on every port (not a child of it).
    ``timeout`` bounds the whole wait, every attempt together; on any failure the
    process is stopped before the error is raised.
    """

    def __init__(
        self,
        launch: Callable[[tuple[int, ...]], T],
        *,
        ports: int = 1,
        what: str = "server",
        log: Path | None = None,
        attempts: int = 5,
        timeout: float = 60.0,
        choose_port: Callable[[], int] | None = None,
    ) -> None:
        if ports < 1 or attempts < 1 or timeout <= 0:
            raise ValueError("ports and attempts must be at least 1, timeout positive")
        self._launch_fn: Callable[[tuple[int, ...]], T] = launch
        self.count, self.what, self.log = ports, what, log
        self.attempts, self.timeout, self._choose = attempts, timeout, choose_port
        self.attempt = 0
        self.ports: tuple[int, ...] = ()
        self.process: T | None = None
        self._log_pos = 0
        self._log_tail = b""
        self._started_at = 0.0

    # --- one attempt --------------------------------------------------------------------
    def _pick(self) -> tuple[int, ...]:
        choose = self._choose or free_port  # looked up now: tests monkeypatch free_port
        picked: list[int] = []
        for _ in range(100 * self.count):
            port = choose()
            if port not in picked:
                picked.append(port)
            if len(picked) == self.count:
                return tuple(picked)
        raise RuntimeError(f"{self.what}: the port chooser keeps returning {picked}")

    def _log_path(self) -> Path | None:
        if isinstance(self.process, ManagedProcess):
            return self.process.log_path
        return self.log

    def _launch(self) -> None:
        self.attempt += 1
        self.ports = self._pick()
        if self.log is not None:
            try:
                self._log_pos = self.log.stat().st_size
            except FileNotFoundError:
                self._log_pos = 0
        self.process = self._launch_fn(self.ports)
        if isinstance(self.process, ManagedProcess):
            self._log_pos = self.process.log_start
        self._log_tail = b""

    def _logged_conflict(self) -> bool | None:
        """Whether the server's log (since this attempt began) reports a bind conflict;
        None if there is no log to read."""
        path = self._log_path()
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                f.seek(self._log_pos)
                new = f.read()
        except FileNotFoundError:
            return False
        self._log_pos += len(new)
        text = self._log_tail + new  # a match may straddle two reads
        self._log_tail = text[-64:]
        return BIND_CONFLICT.search(text) is not None

    def _diagnostics(self) -> str:
        if isinstance(self.process, ManagedProcess):
            return self.process.log_tail()
        if self.log is not None:
            try:
                lines = self.log.read_text(errors="replace").splitlines()[-30:]
            except OSError:
                return ""
            return f"[{self.what} log: {self.log}]\n" + "\n".join(lines)
        return ""

    def _note(self, message: str) -> None:
        log.warning("%s", message)
        path = self._log_path()
        if path is not None:
            with open(path, "a") as f:
                f.write(f"[ctj_devcluster] {message}\n")

    # --- the public steps ---------------------------------------------------------------
    def start(self) -> ServerStart[T]:
        self._started_at = time.monotonic()
        self._launch()
        return self

    def wait_bound(self, interval: float = 0.05) -> tuple[T, tuple[int, ...]]:
        if self.process is None:
            raise RuntimeError("start() first")
        deadline = self._started_at + self.timeout
        conflict_seen = False
        while True:
            assert self.process is not None
            popen = _popen(self.process)
            if set(self.ports) <= listening_ports(popen.pid):
                return self.process, self.ports
            code = popen.poll()
            logged = self._logged_conflict()
            conflict_seen = conflict_seen or bool(logged)
            if code is not None or conflict_seen:
                if logged is None:  # no log: was a port taken when it gave up?
                    conflict = any(not _bindable(p) for p in self.ports)
                else:
                    conflict = conflict_seen
                detail = self._diagnostics()
                _stop(self.process)
                if not conflict:
                    raise ProcessDied(
                        f"{self.what} exited with {code} before listening on {self.ports}\n{detail}"
                    )
                if self.attempt >= self.attempts:
                    raise BindConflict(
                        f"{self.what}: ports taken before it could bind them, "
                        f"{self.attempts} times (last: {self.ports})\n{detail}"
                    )
                lost = [p for p in self.ports if not _bindable(p)] or list(self.ports)
                self._note(
                    f"{self.what}: port(s) {', '.join(map(str, lost))} taken by another process "
                    f"before it could bind them; restarting on new ports "
                    f"(attempt {self.attempt + 1} of {self.attempts})"
                )
                conflict_seen = False
                self._launch()
                continue
            if time.monotonic() >= deadline:
                detail = self._diagnostics()
                _stop(self.process)
                raise TimeoutError(
                    f"timed out after {self.timeout:.0f}s waiting for {self.what} to listen "
                    f"on {self.ports}\n{detail}"
                )
            time.sleep(interval)


def retry_on_bind_conflict(
    launch: Callable[[tuple[int, ...]], T],
    *,
    ports: int = 1,
    what: str = "server",
    log: Path | None = None,
    attempts: int = 5,
    timeout: float = 60.0,
    choose_port: Callable[[], int] | None = None,
) -> tuple[T, tuple[int, ...]]:
    """Starts a server with ``launch(ports)`` and returns ``(process, ports)`` once the
    process listens on every one of ``ports`` (``ports`` of them, chosen by
    :func:`free_port`); restarts it on new ports when it lost a race for one. See
    :class:`ServerStart` for the arguments.

    Example (a Popen whose stderr is appended to ``log_path``)::

        proc, (metrics, liveness) = retry_on_bind_conflict(
            lambda p: subprocess.Popen([..., "--metrics-port", str(p[0]),
                                        "--liveness-port", str(p[1])],
                                       stderr=open(log_path, "a")),
            ports=2, what="operator", log=log_path)
    """
    start = ServerStart(
        launch,
        ports=ports,
        what=what,
        log=log,
        attempts=attempts,
        timeout=timeout,
        choose_port=choose_port,
    )
    return start.start().wait_bound()
