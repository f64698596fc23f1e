"""The sidecar's side of the heartbeat: the operator asks, the sidecar answers.

Every ``failureDetection.heartbeatPeriodSeconds`` the operator (its leader) POSTs a
``HeartbeatAsk`` to ``/v1/heartbeat`` on each rank's metrics port, authenticated with the
job's token (``Authorization: Bearer``, the token the pod has from the job's Secret as
``CTJ_CACHE_TOKEN``). The sidecar answers a ``HeartbeatReply``: its attempt and node
rank and, from node rank 0, the last committed checkpoint, so the operator shows it
without S3 credentials. A rank that does not answer within the job's heartbeat timeout
is lost, without waiting for the node-monitor grace.

Why the operator asks rather than the pods writing Leases: pods need no Kubernetes
credentials and the operator creates no Role per job (docs/security.md), and liveness
costs the API server nothing.

The reply also says how long the pod's trainers have not run (``trainer_silent_s``, from
their liveness pulses, liveness.py): a stopped trainer behind a live sidecar is a hung rank.

What the ask carries:
- a checkpoint request (an opaque id): a new one is written, atomically, to
  ``<staging root>/checkpoint-request``, where ``Checkpointer.preemption_requested()``
  finds it (save at the step boundary, wait for the commit, stop: the operator
  checkpoints a job before a planned resize);
- ``ended``: the operator ended this pod's attempt, so a commit waiting for other ranks'
  parts stops waiting (those ranks are being torn down);
- the pod's ``Assignment`` in the current attempt (``ctj_contract.launch``): pods outlive
  attempts, so a pod kept from a failed attempt gets one newer than the attempt it serves.
  The sidecar ends the old attempt, clears what belonged to it (the trainers' liveness
  pulses, the checkpoint request), writes the assignment to ``<staging>/launch/`` for the
  launcher (which restarts the worker in place) and serves the new attempt and node rank.

The reply also carries the exit status of the served attempt's worker where it ended and
the pod runs on (``<staging>/launch/exit.json``, which the launcher writes).

A request without the job's token is refused (401) and changes nothing. The names and
the messages' forms are the contract's (``ctj_contract``), which the operator imports too.
It imports nothing heavy and never touches torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ctj_contract import Env, HeartbeatAsk, HeartbeatReply, LastCheckpoint, rfc3339
from ctj_contract.launch import (
    ASSIGNMENT_FILE,
    EXIT_FILE,
    Assignment,
    WorkerExit,
    read_small,
    write_atomic,
)
from ctj_contract.tokens import tokens_match

from .errors import CheckpointError
from .liveness import PulseWatch, clear_pulses
from .metrics import HeartbeatMetrics
from .save.slots import read_request, request_path, write_request

log = logging.getLogger("ctj.heartbeat")

Response = tuple[int, str, bytes]


class CommittedCheckpoint(Protocol):
    """What the reply reports of a manifest."""

    @property
    def step(self) -> int: ...

    @property
    def created(self) -> float: ...

    @property
    def logical_bytes(self) -> int: ...


def last_checkpoint_value(manifest: CommittedCheckpoint) -> str:
    """The last-checkpoint report: step, time and logical bytes (the contract's form)."""
    return LastCheckpoint(
        step=int(manifest.step), time=rfc3339(manifest.created), bytes=int(manifest.logical_bytes)
    ).encode()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatSettings:
    token: str = dataclasses.field(repr=False)
    """The job's token: an ask without it is refused."""
    attempt: int
    node_rank: int | None
    """None: not told (a PyTorchJob's Worker; not rank 0)."""

    def __post_init__(self) -> None:
        if not self.token:
            raise CheckpointError("the heartbeat needs the job's token (CTJ_CACHE_TOKEN)")
        if self.attempt < 0 or (self.node_rank is not None and self.node_rank < 0):
            raise CheckpointError("CTJ_ATTEMPT and NODE_RANK must be non-negative integers")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HeartbeatSettings | None:
        """CTJ_CACHE_TOKEN (unset: not in a pod the operator made, no heartbeat),
        CTJ_ATTEMPT (0 where unset) and NODE_RANK (None where unset)."""
        env = os.environ if env is None else env
        token = (env.get(Env.CACHE_TOKEN) or "").strip()
        if not token:
            return None
        numbers: dict[str, int | None] = {}
        for name in (Env.ATTEMPT, Env.NODE_RANK):
            raw = (env.get(name) or "").strip()
            try:
                numbers[name] = int(raw) if raw else None
            except ValueError:
                raise CheckpointError(f"{name}={raw!r} is not an integer") from None
        attempt = numbers[Env.ATTEMPT] or 0
        return cls(token=token, attempt=attempt, node_rank=numbers[Env.NODE_RANK])


class HeartbeatEndpoint:
    """``/v1/heartbeat``'s handler (``handle`` is called on the metrics server's threads).

    ``latest`` gives the last committed manifest (``Persister.latest_committed``), ``root``
    is the job's staging root (where the trainers' liveness pulses are read, liveness.py,
    and the checkpoint request written), ``launch`` the launch directory on the pod's
    staging volume (``ctj_contract.launch.launch_dir``; None: assignments are not relayed,
    no worker exit is reported), ``on_ended`` runs once for each attempt the operator says
    is over, with its number (``Persister.attempt_ended``).

    The attempt and node rank served start as ``settings`` says (the pod's environment)
    and move on with each newer assignment; the lock guards them.
    """

    def __init__(
        self,
        settings: HeartbeatSettings,
        *,
        latest: Callable[[], CommittedCheckpoint | None],
        root: Path,
        launch: Path | None = None,
        on_ended: Callable[[int], None] | None = None,
        metrics: HeartbeatMetrics | None = None,
    ) -> None:
        self.settings = settings
        self._latest = latest
        self.root = Path(root)
        self.launch = None if launch is None else Path(launch)
        self._on_ended = on_ended
        self.metrics = metrics
        self.trainers = PulseWatch(self.root)
        self.attempt = settings.attempt
        self.node_rank = settings.node_rank
        self.request_seen: str | None = read_request(self.root)
        self.ended_attempt: int | None = None
        """The newest attempt ended (on_ended ran for it)."""
        self.reported: str | None = None
        self._exit_warned: str | None = None
        self._lock = threading.Lock()  # asks may overlap (a slow one, then the next)

    @property
    def ended(self) -> bool:
        """Whether the attempt served is over."""
        return self.ended_attempt is not None and self.ended_attempt >= self.attempt

    def handle(self, body: bytes, authorization: str | None) -> Response:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme != "Bearer" or not tokens_match(self.settings.token, given.strip()):
            self._count(refused=True)
            return 401, "text/plain", b"the job's token is required\n"
        try:
            ask = HeartbeatAsk.decode(body)
        except ValueError as exc:
            self._count(refused=True)
            return 400, "text/plain", f"{exc}\n".encode()
        with self._lock:
            if ask.assignment is not None and ask.assignment.attempt > self.attempt:
                self._adopt(ask.assignment)
            if ask.attempt == self.attempt:
                self._take_request(ask.checkpoint_request)
            # an ask older than the attempt served (a stale view) ends nothing
            if (ask.ended and ask.attempt >= self.attempt) or ask.attempt > self.attempt:
                self._end()
            reply = HeartbeatReply(
                attempt=self.attempt,
                node_rank=self.node_rank,
                request_seen=self.request_seen,
                last_checkpoint=self._report(),
                trainer_silent_s=self.trainers.silent_s(),
                **self._worker_exit(),
            )
        self._count(refused=False)
        return 200, "application/json", reply.encode()

    def _adopt(self, assignment: Assignment) -> None:
        """A newer attempt for this pod: end the one served, clear what belonged to it,
        hand the assignment to the launcher, serve the new one. Where the assignment
        cannot be written nothing is adopted: the operator asks again with the next beat."""
        if self.launch is None:
            return
        self._end()
        # the old worker is being stopped: its pulse, left, would read as a hung rank
        # (cleared before the launcher can start the new worker, whose pulse it keeps)
        clear_pulses(self.root)
        # a request belongs to an attempt: the old one's must not stop the new worker
        try:
            request_path(self.root).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("heartbeat: cannot remove the old checkpoint request: %s", exc)
        self.request_seen = None
        try:
            write_atomic(self.launch / ASSIGNMENT_FILE, assignment.encode())
        except OSError as exc:
            log.warning(
                "heartbeat: cannot write attempt %d's assignment to %s: %s",
                assignment.attempt,
                self.launch,
                exc,
            )
            return
        self.attempt = assignment.attempt
        self.node_rank = assignment.node_rank
        log.info(
            "heartbeat: attempt %d assigned (node rank %d of %d): "
            "the launcher restarts the worker in place",
            assignment.attempt,
            assignment.node_rank,
            assignment.world_size,
        )

    def _worker_exit(self) -> dict[str, Any]:
        """The served attempt's worker's exit status and last line, where the launcher
        wrote them (the reply's ``worker_exit`` and ``worker_message``)."""
        if self.launch is None:
            return {}
        path = self.launch / EXIT_FILE
        try:
            raw = read_small(path)
            if raw is None:
                return {}
            found = WorkerExit.decode(raw)
        except (OSError, ValueError) as exc:
            what = f"{type(exc).__name__}: {exc}"
            if what != self._exit_warned:  # once per distinct trouble, not every beat
                self._exit_warned = what
                log.warning("heartbeat: ignoring %s: %s", path, what)
            return {}
        if found.attempt != self.attempt:
            return {}
        return {"worker_exit": found.code, "worker_message": found.message or None}

    def _report(self) -> str | None:
        if self.node_rank != 0:
            return None
        latest = self._latest()
        if latest is None:
            return None
        value = last_checkpoint_value(latest)
        if value != self.reported:
            log.info("heartbeat: reporting the last checkpoint %s", value)
            self.reported = value
        return value

    def _take_request(self, request: str | None) -> None:
        if request is None or request == self.request_seen:
            return
        try:
            path = write_request(self.root, request)
        except OSError as exc:  # the operator asks again with the next beat
            log.warning("heartbeat: cannot write the checkpoint request: %s", exc)
            return
        self.request_seen = request
        log.info("heartbeat: checkpoint requested (id %r): wrote %s", request, path)

    def _end(self) -> None:
        """The attempt served is over (once per attempt)."""
        if self.ended:
            return
        self.ended_attempt = self.attempt
        log.info("heartbeat: the operator ended attempt %d", self.attempt)
        if self._on_ended is not None:
            self._on_ended(self.attempt)

    def _count(self, *, refused: bool) -> None:
        if self.metrics is not None:
            (self.metrics.refused if refused else self.metrics.beats).inc()
