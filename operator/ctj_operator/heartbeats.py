"""The operator's side of the heartbeat: the leader asks every rank's sidecar, each period.

The pod watch tells the channel where each rank runs (``track``: its IP, job, attempt and
node rank, once Running); each reconcile tells it what to say to the job's ranks
(``want``: the attempt its status has, whether that attempt is over, the checkpoint
request of a planned transition, all read from the job's status, so an operator that
restarts says the same). A background task (``run``, on kopf's event loop, leader only)
POSTs a ``HeartbeatAsk`` to each rank's ``/v1/heartbeat`` every job's
``failureDetection.heartbeatPeriodSeconds``, with the job's token; each valid reply is
marked in ``Marks.beats`` by when this process received it, which the decisions judge
against the job's heartbeat timeout (``HeartbeatLost``). Rank 0's reply carries the last
committed checkpoint; every reply says how long the pod's trainers have not run
(``Marks.trainers``, judged as ``RankHung``: a stopped trainer behind a live sidecar).

No API request per beat, and pods need no Kubernetes credentials: the trainer_sidecar
heartbeat module's docstring says why. A rank this process has not heard from yet (its
sidecar still starting on a busy node, or any rank after this operator started or was
elected) is judged from when it was first seen Running (``Marks.tracked``) against the
longer startup grace (decisions.STARTUP_GRACE_S), not the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ctj_contract import (
    HEARTBEAT_PATH,
    Assignment,
    HeartbeatAsk,
    HeartbeatReply,
    LastCheckpoint,
    Phase,
)
from ctj_contract.launch import WorkerExit
from ctj_contract.tokens import job_token

from .builders import METRICS_PORT, master_addr, master_port, pod_name
from .decisions import JobState
from .observe import Freshness, JobKey
from .spec import JobSpec

log = logging.getLogger("ctj.operator.heartbeat")

TICK_S = 0.2
"""How often the task looks for ranks due an ask (an ask goes out at most this late)."""
LOG_EVERY_S = 60.0
MAX_REPLY = 16 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Rank:
    """A rank's pod, where the channel asks it."""

    job: JobKey
    pod: str
    ip: str
    attempt: int
    node_rank: int


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """What a job's pods are assigned in its current attempt (``ctj_contract.launch``)."""

    world_size: int
    nproc_per_node: int
    master_addr: str


@dataclasses.dataclass(frozen=True, slots=True)
class JobAsk:
    """What the channel says to a job's ranks (from its status), and how often."""

    uid: str
    attempt: int
    ended: bool
    request: str | None
    period_s: float
    placement: Placement | None = None
    """Where the pods run the launcher: each rank's place in the attempt, so a pod kept
    from the attempt before restarts its worker in place (None: not told)."""

    @classmethod
    def of(
        cls, uid: str, state: JobState, period_s: float, *, job: str = "", nproc: int = 1,
        relaunches: bool = False,
    ) -> JobAsk:  # fmt: skip
        """From the job's status alone (an operator that restarts says the same): the
        attempt, whether it is over, the checkpoint request of a planned transition and,
        where the pods run the launcher, their placement (the rendezvous is node rank 0's
        pod: the first carried, or the one this attempt made)."""
        ended = state.phase in (Phase.RESTARTING, Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED)
        placement = None
        if relaunches and state.attempt and state.world_size and not ended:
            rank0 = state.carried[0] if state.carried else pod_name(job, state.attempt, 0)
            placement = Placement(state.world_size, nproc, master_addr(job, rank0))
        return cls(
            uid=uid,
            attempt=state.attempt,
            ended=ended,
            request=state.transition.request_id if state.transition else None,
            period_s=period_s,
            placement=placement,
        )

    @classmethod
    def for_job(cls, uid: str, job: str, spec: JobSpec, state: JobState) -> JobAsk:
        """``of``, with the period, ranks per pod and launcher the job's spec gives."""
        period = spec.detection.heartbeat_period_seconds
        return cls.of(
            uid, state, period, job=job, nproc=spec.nproc_per_node, relaunches=spec.relaunches
        )

    def ask_for(self, rank: Rank) -> HeartbeatAsk:
        """A pod of an older attempt is told its attempt is over; only the current
        attempt's ranks get the checkpoint request and their assignment."""
        current = rank.attempt == self.attempt
        return HeartbeatAsk(
            attempt=self.attempt,
            ended=self.ended or not current,
            checkpoint_request=self.request if current else None,
            assignment=self._assignment(rank.node_rank) if current else None,
        )

    def _assignment(self, node_rank: int) -> Assignment | None:
        where = self.placement
        if where is None or not 0 <= node_rank < where.world_size:
            return None
        return Assignment(
            attempt=self.attempt,
            node_rank=node_rank,
            world_size=where.world_size,
            nproc_per_node=where.nproc_per_node,
            master_addr=where.master_addr,
            master_port=master_port(self.attempt),
        )


STALL_SLACK_S = 0.5
"""A tick later than this past its time means this process was not running its asks."""


class LoopClock:
    """Monotonic seconds, less the time the channel's loop was stalled.

    A rank's silence is measured by this clock, so time this process itself did not run
    (its event loop blocked, the process starved of CPU or paused) is never held against
    the ranks: it could not ask them. The stall in progress is left out as well, so a
    reconcile that runs before the channel's next tick does not judge by it either."""

    def __init__(self, tick_s: float = TICK_S, slack_s: float = STALL_SLACK_S) -> None:
        self._expected = tick_s + slack_s
        self._last = time.monotonic()
        self._lost = 0.0

    def _late(self, now: float) -> float:
        late = now - self._last - self._expected
        return late if late > 0 else 0.0

    def tick(self) -> None:
        now = time.monotonic()
        self._lost += self._late(now)
        self._last = now

    def __call__(self) -> float:
        now = time.monotonic()
        return now - self._lost - self._late(now)


def timeout_for(period_s: float) -> float:
    """One ask's limit: a slow sidecar delays its next ask by no more."""
    return max(1.0, min(5.0, 2 * period_s))


class HeartbeatChannel:
    def __init__(
        self,
        key: bytes,
        beats: Freshness,
        *,
        trainers: dict[tuple[str, str], float] | None = None,
        tracked: Freshness | None = None,
        workers: Freshness | None = None,
        port: int = METRICS_PORT,
    ) -> None:
        self._key = key
        self.clock = LoopClock()
        self.beats = beats
        self.tracked = Freshness() if tracked is None else tracked
        for marks in (beats, self.tracked):  # silences exclude this process's own stalls
            marks.clock = self.clock
        self.trainers: dict[tuple[str, str], float] = {} if trainers is None else trainers
        self.workers = Freshness() if workers is None else workers
        self.port = port
        self.ranks: dict[tuple[str, str], Rank] = {}
        self.jobs: dict[JobKey, JobAsk] = {}
        self._reports: dict[JobKey, LastCheckpoint] = {}
        self._tokens: dict[str, str] = {}
        self._due: dict[tuple[str, str], float] = {}
        self._in_flight: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._answers = 0
        self._logged: dict[tuple[str, str], float] = {}

    # -- what the watches and the reconciles tell it ----------------------------------

    def track(self, namespace: str, job: str, summary: Mapping[str, Any]) -> None:
        """A pod of a job, as the pod index summarizes it: asked while Running with an IP."""
        key = (namespace, summary["name"])
        ip = summary.get("ip")
        if summary["phase"] != "Running" or not ip:
            self.untrack(namespace, summary["name"])
            return
        rank = Rank((namespace, job), summary["name"], ip, summary["attempt"], summary["rank"])
        old = self.ranks.get(key)
        if old != rank:
            if old is not None and old.attempt != rank.attempt:  # kept for the next attempt:
                self.trainers.pop(key, None)  # what its old worker did is not this one's
                self.workers.drop(key)
            self.ranks[key] = rank
            self.tracked.see(key, ip)  # unanswered since: judged against the startup grace
            self._due[key] = 0.0

    def untrack(self, namespace: str, pod: str) -> None:
        key = (namespace, pod)
        self.ranks.pop(key, None)
        self._due.pop(key, None)
        self.trainers.pop(key, None)
        self.workers.drop(key)
        self.tracked.drop(key)

    def want(self, job: JobKey, ask: JobAsk) -> None:
        """What to say to the job's ranks from now on; a change (an attempt ended or
        started, a checkpoint request) is said at once, not at each rank's next beat."""
        if self.jobs.get(job) != ask:
            for key, rank in self.ranks.items():
                if rank.job == job:
                    self._due[key] = 0.0
        self.jobs[job] = ask

    def forget_job(self, job: JobKey) -> None:
        self.jobs.pop(job, None)
        self._reports.pop(job, None)

    def last_checkpoint(self, job: JobKey) -> dict[str, Any] | None:
        """The newest checkpoint the job's rank 0 reported to this process."""
        found = self._reports.get(job)
        return None if found is None else found.as_status()

    def token(self, job: JobKey, uid: str) -> str:
        if uid not in self._tokens:
            self._tokens[uid] = job_token(self._key, job[0], job[1], uid)
        return self._tokens[uid]

    # -- the task ------------------------------------------------------------------------

    async def run(self, leads: Callable[[], bool]) -> None:
        """Ask every tracked rank of a known job when due, while this process leads."""
        while True:
            self.clock.tick()
            if leads():
                self._ask_due()
            await asyncio.sleep(TICK_S)

    def _ask_due(self) -> None:
        now = time.monotonic()
        for key, rank in list(self.ranks.items()):
            job = self.jobs.get(rank.job)
            if job is None or key in self._in_flight or self._due.get(key, 0.0) > now:
                continue
            self._due[key] = now + job.period_s
            self._in_flight.add(key)
            task = asyncio.get_running_loop().create_task(self._ask_once(key, rank, job))
            self._tasks.add(task)  # held: the loop keeps only a weak reference
            task.add_done_callback(self._tasks.discard)

    async def _ask_once(self, key: tuple[str, str], rank: Rank, job: JobAsk) -> None:
        try:
            await self.ask(key, rank, job)
        finally:
            self._in_flight.discard(key)

    async def ask(self, key: tuple[str, str], rank: Rank, job: JobAsk) -> bool:
        """One ask; True if a valid reply came back (marked as a beat)."""
        url = f"http://{_host(rank.ip)}:{self.port}{HEARTBEAT_PATH}"
        token = self.token(rank.job, job.uid)
        try:
            status, raw = await asyncio.wait_for(
                post(rank.ip, self.port, job.ask_for(rank).encode(), token),
                timeout_for(job.period_s),
            )
            if status != 200:
                self._warn(key, f"{url} answered {status}: {raw[:200]!r}")
                return False
            reply = HeartbeatReply.decode(raw)
        except (OSError, TimeoutError, ValueError) as exc:
            self._warn(key, f"{url}: {type(exc).__name__}: {exc}")
            return False
        if reply.attempt != rank.attempt or reply.node_rank not in (None, rank.node_rank):
            self._warn(key, f"{url} is attempt {reply.attempt} rank {reply.node_rank}, not ours")
            return False
        if self.ranks.get(key) == rank:  # not untracked meanwhile
            self._answers += 1
            self.beats.see(key, self._answers)
            if reply.trainer_silent_s is None:
                self.trainers.pop(key, None)
            else:
                self.trainers[key] = reply.trainer_silent_s
            if reply.worker_exit is None:
                self.workers.drop(key)
            else:
                with contextlib.suppress(ValueError):  # a code out of range: not an exit
                    ended = WorkerExit(reply.attempt, reply.worker_exit, reply.worker_message or "")
                    self.workers.see(key, ended)
        found = LastCheckpoint.decode(reply.last_checkpoint) if rank.node_rank == 0 else None
        best = self._reports.get(rank.job)
        if found is not None and (best is None or found.step > best.step):
            self._reports[rank.job] = found
        return True

    def _warn(self, key: tuple[str, str], why: str) -> None:
        """One line per pod at most every LOG_EVERY_S (a lost node fails every ask)."""
        now = time.monotonic()
        if now - self._logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[key] = now
            log.info("heartbeat of pod %s/%s: %s", key[0], key[1], why)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


async def post(ip: str, port: int, body: bytes, token: str) -> tuple[int, bytes]:
    """One HTTP/1.1 POST of ``body`` to the heartbeat path, ``Connection: close``; returns
    (status, body). At most MAX_REPLY bytes are read (a hostile answer cannot grow our
    memory); the caller bounds the time. The operator image needs no HTTP client library."""
    reader, writer = await asyncio.open_connection(ip, port)
    try:
        head = (
            f"POST {HEARTBEAT_PATH} HTTP/1.1\r\nHost: {_host(ip)}:{port}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        raw = b""
        while len(raw) <= MAX_REPLY:
            chunk = await reader.read(MAX_REPLY + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    if len(raw) > MAX_REPLY:
        raise ValueError(f"a reply over {MAX_REPLY} bytes")
    header, sep, content = raw.partition(b"\r\n\r\n")
    status_line = header.split(b"\r\n", 1)[0].split()
    if not sep or len(status_line) < 2 or not status_line[1].isdigit():
        raise ValueError("not an HTTP reply")
    return int(status_line[1]), content


async def start(channel: HeartbeatChannel, leads: Callable[[], bool]) -> asyncio.Task[None]:
    """The channel's task on the running loop (kopf's), cancelled by ``stop``."""
    return asyncio.get_running_loop().create_task(channel.run(leads), name="ctj-heartbeats")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
