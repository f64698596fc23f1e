"""Whether each trainer in the pod still runs: a pulse it writes, read by its sidecar.

A rank whose trainer is stopped (SIGSTOP, a frozen process, a hung container runtime) still
has a sidecar that answers the operator's heartbeat, so the heartbeat alone would never
call it lost, and its peers would wait in their next collective until its timeout (minutes).

So each trainer writes a pulse: a daemon thread (``Pulse``) rewrites a counter in
``<staging root>/alive-<rank>`` every ``PULSE_PERIOD_S``. The sidecar (``PulseWatch``) reads
the counters on each heartbeat ask and notes, by its own monotonic clock, when each last
changed; its reply carries the longest silence among the pod's trainers
(``HeartbeatReply.trainer_silent_s``) and the operator ends the attempt when that passes
``failureDetection.heartbeatTimeoutSeconds`` (``RankHung``).

What counts as alive is deliberately little: the trainer's process is scheduled and a
thread of it gets the GIL. A slow step, a long collective, a GC pause of a second or a
save do not stop the pulse (the thread runs while the main thread waits in C code). A
stop or freeze of the whole process does, and so does C code holding the GIL past the
timeout. A trainer that ends cleanly removes its file (``Pulse.stop``): a rank that is done
is not hung. The counter's value means nothing across processes, only its changes do, so no
two clocks are ever compared.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("ctj.liveness")

PULSE_PREFIX = "alive-"
PULSE_PERIOD_S = 0.5
"""How often a trainer's pulse changes: well under the smallest heartbeat timeout (1.5 s)."""
MAX_PULSE_FILES = 1024
"""A pod runs a few ranks; more files than this are not read (a full directory is no DoS)."""
_WIDTH = 20


def pulse_path(root: Path, rank: int) -> Path:
    return Path(root) / f"{PULSE_PREFIX}{rank}"


class Pulse:
    """The trainer's side: a daemon thread that rewrites ``alive-<rank>`` every period."""

    def __init__(self, root: Path, rank: int, *, period_s: float = PULSE_PERIOD_S) -> None:
        self.path = pulse_path(root, rank)
        self.period_s = period_s
        self._stop = threading.Event()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._count = 0
        self._beat()
        self._thread = threading.Thread(target=self._run, name="ctj-pulse", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._count += 1
        os.pwrite(self._fd, b"%0*d\n" % (_WIDTH, self._count), 0)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._beat()
            except OSError as exc:  # the staging volume went away: the pod is ending
                log.warning("liveness pulse stopped: cannot write %s: %s", self.path, exc)
                return

    def stop(self) -> None:
        """The trainer is done: stop beating and remove the file (not hung, finished)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(self.period_s + 1)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class PulseWatch:
    """The sidecar's side: when each trainer's pulse last changed, by this process's clock.

    A pulse first seen counts as just changed (a sidecar that starts late gives each
    trainer a whole timeout). Thread-safe: asks may overlap."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._seen: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def silent_s(self) -> float | None:
        """Seconds since the longest-silent trainer's pulse last changed; None while no
        trainer of this pod has a pulse (not started yet, finished, or not using ctj)."""
        now = time.monotonic()
        values = _read_pulses(self.root)
        with self._lock:
            for name in list(self._seen):
                if name not in values:
                    del self._seen[name]
            for name, value in values.items():
                old = self._seen.get(name)
                if old is None or old[0] != value:
                    self._seen[name] = (value, now)
            if not self._seen:
                return None
            return max(now - changed for _, changed in self._seen.values())


def clear_pulses(root: Path) -> int:
    """Remove the trainers' pulses in ``root`` (their worker is being replaced: a pulse
    left behind would read as a hung rank); how many were removed. Never raises."""
    removed = 0
    try:
        entries = os.scandir(root)
    except OSError:
        return removed
    with entries:
        for entry in entries:
            if not entry.name.startswith(PULSE_PREFIX):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    continue
                os.unlink(entry.path)
            except OSError:  # gone already, or not ours to remove
                continue
            removed += 1
    return removed


def _read_pulses(root: Path) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    try:
        entries = os.scandir(root)
    except OSError:
        return found
    with entries:
        for entry in entries:
            if len(found) >= MAX_PULSE_FILES:
                break
            try:
                if entry.name.startswith(PULSE_PREFIX) and entry.is_file(follow_symlinks=False):
                    found[entry.name] = _read_small(entry.path)
            except OSError:  # removed between the listing and the read: finished
                continue
    return found


def _read_small(path: str) -> bytes:
    """A pulse's bytes; never follows a link nor blocks on a FIFO put in its place."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        return os.read(fd, _WIDTH + 1)
    finally:
        os.close(fd)
