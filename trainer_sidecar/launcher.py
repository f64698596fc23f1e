"""The trainer container's main process: runs the trainer, restarts it in place on an
assignment, and keeps the pod up between attempts (``ctj_contract.launch``).

``python -m trainer_sidecar.launcher [--grace-seconds S] [--poll-seconds P] -- CMD...``
starts CMD (the worker) with the pod's environment, then polls
``<staging>/launch/assignment.json``. An assignment newer than the attempt the worker runs
stops the worker (SIGTERM to its process group, SIGKILL after the grace: none by default,
the attempt is over, its saves fenced, and a worker stuck in a collective with a lost
peer would only spend it) and starts CMD again with the assignment's environment: a
survivor of a failure joins the next attempt without a new pod (no scheduling, no image
pull, its node cache kept). A worker that
exits non-zero is reported in ``exit.json`` and the pod stays up for the operator's next
assignment; one that exits 0 ends the launcher with 0. On a warm spare (``CTJ_STANDBY=1``)
no worker runs until the first assignment.

The worker runs in its own session, so one signal to its process group reaches torchrun
and every rank it started, and never the launcher. SIGTERM, SIGINT and SIGHUP to the
launcher (the kubelet stopping the pod) go to that group, and the launcher exits as the
worker did. Signal handlers only record the signal; the loop acts on it, woken at once
by ``signal.set_wakeup_fd`` (SIGCHLD wakes it too, when the worker exits). As a
container's PID 1 the launcher also reaps the orphans a killed torchrun leaves.

The launcher imports only the standard library and ``ctj_contract``: it starts in a
fraction of a second, before any of torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from ctj_contract.env import Env
from ctj_contract.launch import (
    ASSIGNMENT_FILE,
    EXIT_FILE,
    Assignment,
    WorkerExit,
    launch_dir,
    read_small,
    write_atomic,
)

log = logging.getLogger("ctj.launcher")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def preload_modules(value: str) -> list[str]:
    """CTJ_PRELOAD's module names (comma-separated); a name that is not one is left out."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    good = [n for n in names if all(part.isidentifier() for part in n.split("."))]
    if len(good) != len(names):
        log.warning("ctj launcher: %s: not module names: %s", Env.PRELOAD,
                    sorted(set(names) - set(good)))  # fmt: skip
    return good


_STOP_POLL_S = 0.01
FileState = tuple[int, int, int, int]
"""What a cheap ``lstat`` says of a file (inode, size, mtime, mode): a change means read it."""


def file_state(path: Path) -> FileState | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


def read_assignment(
    path: Path, seen: FileState | None
) -> tuple[FileState | None, Assignment | None]:
    """The file's state now, and the assignment it holds where that state is not ``seen``.
    A file that is malformed, too big, a link or not a regular file is logged once (its
    state is seen from then on) and ignored; one replaced while read is read again."""
    state = file_state(path)
    if state is None or state == seen:
        return state, None
    found: Assignment | None = None
    error: Exception | None = None
    try:
        raw = read_small(path)
        found = None if raw is None else Assignment.decode(raw)
    except (OSError, ValueError) as exc:
        error = exc
    if file_state(path) != state:
        return seen, None  # replaced while read: the next poll reads the new one
    if error is not None:
        log.warning("ctj launcher: ignoring assignment %s: %s", path, error)
    return state, found


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


TAIL_BYTES = 4096


class Tail:
    """The worker's output (stdout and stderr as one stream, in its order) passed on to
    the launcher's stdout (the container's log), the last few KB of it kept: its last line
    says why a failed worker failed, as the container's termination message would have
    (terminationMessagePolicy FallbackToLogsOnError)."""

    def __init__(self) -> None:
        self._kept = b""
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def copy(self, source: IO[bytes], to_fd: int) -> None:
        thread = threading.Thread(target=self._run, args=(source, to_fd), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _run(self, source: IO[bytes], to_fd: int) -> None:
        with source:
            while chunk := os.read(source.fileno(), 65536):
                with self._lock:
                    self._kept = (self._kept + chunk)[-TAIL_BYTES:]
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(to_fd, view) :]
                    except OSError:  # our own output gone: keep draining the worker's
                        break

    def last_line(self, wait_s: float = 1.0) -> str:
        """The last non-empty line, once the output ended (or ``wait_s`` passed)."""
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            lines = self._kept.decode(errors="replace").splitlines()
        return next((line.strip() for line in reversed(lines) if line.strip()), "")


def _spawn(
    cmd: Sequence[str], env: Mapping[str, str], *, stdin: int | None = None
) -> tuple[subprocess.Popen[bytes], Tail]:
    """``cmd`` in a session of its own, its output (one stream) passed on and its tail kept."""
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        start_new_session=True,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order the worker wrote it
    )
    output = Tail()
    assert proc.stdout is not None
    output.copy(proc.stdout, sys.stdout.fileno())
    return proc, output


# What a standby runs: the modules imported, then one line on stdin says which script to
# run, as ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` would, with what environment.
STANDBY_CODE = r"""
import importlib, json, os, runpy, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
line = sys.stdin.readline()
if not line:
    sys.exit(0)
order = json.loads(line)
os.environ.clear()
os.environ.update(order["env"])
argv = order["argv"]
if argv[0] == "-m":
    sys.argv = argv[1:]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
"""


def standby_argv(cmd: Sequence[str]) -> list[str] | None:
    """What a standby runs for ``cmd``, where it is ``python SCRIPT ...`` or ``python -m
    MODULE ...`` (no other interpreter option); None for anything else (torchrun, a shell,
    a binary), which always starts cold."""
    if len(cmd) < 2 or not Path(cmd[0]).name.startswith("python"):
        return None
    if cmd[1] == "-m":
        return list(cmd[1:]) if len(cmd) >= 3 else None
    return None if cmd[1].startswith("-") else list(cmd[1:])


class Standby:
    """A Python process that has imported ``modules`` (CTJ_PRELOAD, e.g. torch) and waits
    to become the next worker: an in-place restart or a spare's first worker then skips
    the imports. It holds what it imported in memory while it waits."""

    def __init__(self, python: str, modules: Sequence[str], env: Mapping[str, str]) -> None:
        self.proc, self.output = _spawn(
            [python, "-c", STANDBY_CODE, json.dumps(list(modules))], env, stdin=subprocess.PIPE
        )

    def take(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Make it run ``argv`` with ``env``; False where it is gone (start cold)."""
        if self.proc.poll() is not None or self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write(
                json.dumps({"argv": list(argv), "env": dict(env)}).encode() + b"\n"
            )
            self.proc.stdin.close()
        except OSError:
            return False
        return True

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Worker:
    """The command in its own session and process group (its group id is its pid). An
    ended worker is reaped only after its group is killed: its pid, and so the group's id,
    cannot have been reused when the group is signalled. Started cold, or by a standby
    that had imported what it needs."""

    def __init__(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        attempt: int,
        standby: tuple[Standby, Sequence[str]] | None = None,
    ) -> None:
        self.attempt = attempt
        self.warm = standby is not None and standby[0].take(standby[1], env)
        if standby is not None and self.warm:
            self.proc, self.output = standby[0].proc, standby[0].output
        else:
            if standby is not None:
                standby[0].close()
            self.proc, self.output = _spawn(cmd, env)

    def exited(self) -> bool:
        """Whether the worker ended (left unreaped)."""
        if self.proc.returncode is not None:
            return True
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        try:
            return os.waitid(os.P_PID, self.proc.pid, flags) is not None
        except ChildProcessError:
            return True

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def reap(self) -> int:
        """The ended worker's return code, once nothing it started outlives it."""
        self.signal_group(signal.SIGKILL)
        return self.proc.wait()

    def stop(self, grace_s: float) -> int:
        """SIGTERM to the group, SIGKILL after ``grace_s`` (or once the worker ended: what
        it started may linger)."""
        if not self.exited():
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while not self.exited() and time.monotonic() < deadline:
                time.sleep(_STOP_POLL_S)
        return self.reap()


def reap_orphans(keep: int | None) -> None:
    """Reap exited children other than ``keep`` (the worker, which ``Popen`` reaps): the
    ranks of a killed torchrun, reparented to the launcher where it is PID 1."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == keep:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def _env_attempt() -> int:
    value = os.environ.get(Env.ATTEMPT) or "0"
    try:
        return int(value)
    except ValueError:
        log.warning("ctj launcher: %s=%r is not an integer: attempt 0", Env.ATTEMPT, value[:32])
        return 0


def _describe(env: Mapping[str, str]) -> str:
    rank = env.get(Env.NODE_RANK) or env.get("PET_NODE_RANK") or "?"
    master = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return f"node rank {rank} of {env.get('PET_NNODES', '?')} (master {master})"


class Launcher:
    """The poll loop: one worker at a time, the attempt it runs, the signals to act on."""

    def __init__(
        self,
        cmd: Sequence[str],
        launch: Path | None,
        grace_s: float,
        poll_s: float,
        standby_delay_s: float = 10.0,
    ) -> None:
        self.cmd, self.grace_s, self.poll_s = list(cmd), grace_s, poll_s
        self.standby_delay_s = standby_delay_s
        self.preload = preload_modules(os.environ.get(Env.PRELOAD, ""))
        self.standby_argv = standby_argv(self.cmd) if self.preload else None
        if self.preload and self.standby_argv is None:
            log.warning("ctj launcher: %s is set but the command is not `python SCRIPT` or "
                        "`python -m MODULE`: every worker starts cold", Env.PRELOAD)  # fmt: skip
        self.standby: Standby | None = None
        self.started = time.monotonic()
        self.assignment_path = launch / ASSIGNMENT_FILE if launch else None
        self.exit_path = launch / EXIT_FILE if launch else None
        self.attempt = _env_attempt()
        self.seen: FileState | None = None
        self.worker: Worker | None = None
        self.pending: list[int] = []
        self._wake_r, wake_w = os.pipe()
        for fd in (self._wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        for signum in FORWARDED:
            signal.signal(signum, self._record)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the loop

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)

    def _sleep(self) -> None:
        """Up to one poll period; a signal (SIGCHLD included) ends it at once."""
        if select.select([self._wake_r], [], [], self.poll_s)[0]:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)

    def run(self) -> int:
        self._clear_exit()
        first = self._newer()
        if first is None and os.environ.get(Env.STANDBY) == "1":
            log.info("ctj launcher: a warm spare: no worker until an assignment makes it a rank")
            self._prepare_standby(now=True)
        else:
            self._start(first)
        while True:
            if self.pending:
                code = self._on_signal(self.pending.pop(0))
                self._drop_standby()
                return code
            self._prepare_standby()
            if self.worker is not None and self.worker.exited():
                code = self.worker.reap()
                if code == 0 or self.exit_path is None:
                    self._drop_standby()
                    return exit_status(code)
                self._failed(self.worker, code)
            if (newer := self._newer()) is not None:
                self._restart(newer)
            reap_orphans(self.worker.proc.pid if self.worker else None)
            self._sleep()

    def _newer(self) -> Assignment | None:
        if self.assignment_path is None:
            return None
        self.seen, found = read_assignment(self.assignment_path, self.seen)
        if found is not None and found.attempt <= self.attempt:
            level = logging.INFO if found.attempt == self.attempt else logging.WARNING
            log.log(
                level,
                "ctj launcher: ignoring assignment for attempt %d: attempt %d runs",
                found.attempt,
                self.attempt,
            )
            return None
        return found

    def _start(self, assignment: Assignment | None) -> None:
        if self.pending:
            return  # stopping: the loop exits
        env: Mapping[str, str] = os.environ
        if assignment is not None:
            env = {**os.environ, **assignment.environment()}
            env.pop(Env.STANDBY, None)
            self.attempt = assignment.attempt
        standby = None
        if self.standby is not None and self.standby_argv is not None:
            standby = (self.standby, self.standby_argv)
        self.standby = None
        self.worker = Worker(self.cmd, env, self.attempt, standby)
        self.started = time.monotonic()
        log.info(
            "ctj launcher: attempt %d, %s: %s %s",
            self.attempt,
            _describe(env),
            "started (imports done ahead)" if self.worker.warm else "starting",
            shlex.join(self.cmd),
        )

    def _prepare_standby(self, *, now: bool = False) -> None:
        """With CTJ_PRELOAD, keep a standby ready for the next worker: at once on a spare,
        else once the running worker has had ``standby_delay_s`` to start (not competing
        with its own imports for the CPU)."""
        if self.standby_argv is None or self.standby is not None:
            return
        if not now and time.monotonic() - self.started < self.standby_delay_s:
            return
        env = {k: v for k, v in os.environ.items() if k != Env.STANDBY}
        self.standby = Standby(self.cmd[0], self.preload, env)

    def _drop_standby(self) -> None:
        if self.standby is not None:
            self.standby.close()
            self.standby = None

    def _restart(self, assignment: Assignment) -> None:
        if self.worker is not None:
            log.info(
                "ctj launcher: stopping the worker of attempt %d for attempt %d",
                self.worker.attempt,
                assignment.attempt,
            )
            self.worker.stop(self.grace_s)
            self.worker = None
        self._clear_exit()
        self._start(assignment)

    def _failed(self, worker: Worker, code: int) -> None:
        """The worker failed (and nothing it started outlives it): the sidecar reads why."""
        self.worker = None
        ended = WorkerExit(worker.attempt, code, worker.output.last_line())
        assert self.exit_path is not None
        try:
            write_atomic(self.exit_path, ended.encode())
        except OSError as exc:
            log.error("ctj launcher: cannot write %s: %s", self.exit_path, exc)
        log.warning(
            "ctj launcher: worker of attempt %d %s; the pod stays up for the "
            "operator's next assignment",
            worker.attempt,
            ended.describe(),
        )

    def _clear_exit(self) -> None:
        if self.exit_path is not None:
            with contextlib.suppress(OSError):
                self.exit_path.unlink(missing_ok=True)

    def _on_signal(self, signum: int) -> int:
        """Forward to the worker's group (and any signal after it) and exit as it does; the
        kubelet's grace period bounds the wait."""
        if self.worker is None:
            log.info("ctj launcher: %s and no worker runs: exiting", signal.Signals(signum).name)
            return 128 + signum
        log.info("ctj launcher: forwarding %s to the worker", signal.Signals(signum).name)
        self.worker.signal_group(signum)
        while not self.worker.exited():
            self._sleep()
            while self.pending:
                self.worker.signal_group(self.pending.pop(0))
        return exit_status(self.worker.reap())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer_sidecar.launcher",
        usage="%(prog)s [--grace-seconds S] [--poll-seconds P] -- CMD [ARGS...]",
        description="Run CMD as the trainer; restart it in place on a newer assignment.",
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=0.0,
        help="SIGTERM to SIGKILL on a restart (default 0: the old attempt is over)",
    )
    parser.add_argument(
        "--standby-delay-seconds",
        type=float,
        default=10.0,
        help="with CTJ_PRELOAD: a worker runs this long before the next one's standby starts",
    )
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=0.1,
        help="how often the assignment is read (default 0.1)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    split = args.index("--") if "--" in args else len(args)
    opts, cmd = parser.parse_args(args[:split]), args[split + 1 :]
    if not cmd:
        parser.error("no command after --")
    if opts.grace_seconds < 0 or opts.poll_seconds <= 0:
        parser.error("--grace-seconds must be >= 0 and --poll-seconds > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    launch: Path | None = None
    staging = os.environ.get(Env.STAGING_DIR)
    if not staging:
        log.warning("ctj launcher: %s is not set: in-place restarts are off", Env.STAGING_DIR)
    else:
        try:
            launch = launch_dir(staging)
            launch.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("ctj launcher: in-place restarts are off: %s", exc)
            launch = None
    return Launcher(
        cmd, launch, opts.grace_seconds, opts.poll_seconds, opts.standby_delay_seconds
    ).run()


if __name__ == "__main__":
    sys.exit(main())
