"""The heartbeat, both sides: the sidecar's endpoint (the job's token, the checkpoint
request written once, the attempt's end, rank 0's report) and the operator's channel
asking a real sidecar HTTP server (trainer_sidecar.metrics.serve) over loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from ctj_contract import HEARTBEAT_PATH, HeartbeatAsk, HeartbeatReply, LastCheckpoint
from ctj_contract.launch import ASSIGNMENT_FILE, EXIT_FILE, Assignment, WorkerExit, write_atomic
from ctj_operator.heartbeats import HeartbeatChannel, JobAsk, LoopClock, Rank
from ctj_operator.observe import Freshness

from tests.conftest import ROOT
from trainer_sidecar import heartbeat as hb
from trainer_sidecar.errors import CheckpointError
from trainer_sidecar.liveness import pulse_path
from trainer_sidecar.metrics import CheckpointMetrics, HeartbeatMetrics, serve
from trainer_sidecar.save import slots

T0 = 1796126400.0  # 2026-12-01T12:00:00Z
TOKEN = "t" * 64


@dataclasses.dataclass
class Commit:
    step: int
    created: float = T0
    logical_bytes: int = 4096


def endpoint(
    tmp_path: Path,
    *,
    node_rank: int | None = 0,
    attempt: int = 2,
    latest: Commit | None = None,
    launch: Path | None = None,
) -> tuple[hb.HeartbeatEndpoint, list[int]]:
    """The endpoint serving ``tmp_path`` as its staging root; ``ended`` lists the attempts
    it said were over, in order."""
    ended: list[int] = []
    settings = hb.HeartbeatSettings(token=TOKEN, attempt=attempt, node_rank=node_rank)
    ep = hb.HeartbeatEndpoint(
        settings,
        latest=lambda: latest,
        root=tmp_path,
        launch=launch,
        on_ended=ended.append,
        metrics=HeartbeatMetrics(CheckpointMetrics().registry),
    )
    return ep, ended


def ask(ep: hb.HeartbeatEndpoint, body: HeartbeatAsk, token: str = TOKEN) -> HeartbeatReply:
    code, _, raw = ep.handle(body.encode(), f"Bearer {token}")
    assert code == 200, raw
    return HeartbeatReply.decode(raw)


def test_an_ask_without_the_job_token_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    ep, ended = endpoint(tmp_path)
    body = HeartbeatAsk(attempt=2, ended=True, checkpoint_request="r-1").encode()
    for auth in (None, "", "Bearer", f"Bearer {TOKEN[:-1]}x", f"Basic {TOKEN}", TOKEN):
        code, _, _ = ep.handle(body, auth)
        assert code == 401
    assert slots.read_request(tmp_path) is None and ended == [] and ep.request_seen is None


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[]", b'{"attempt": -1}', b'{"attempt": true}', b'{"attempt": 1, '
     b'"ended": "yes"}', b'{"attempt": 1, "request": 5}', b"{" + b" " * 5000 + b"}"],
)  # fmt: skip
def test_a_malformed_ask_is_a_400(tmp_path: Path, raw: bytes) -> None:
    ep, ended = endpoint(tmp_path)
    code, _, _ = ep.handle(raw, f"Bearer {TOKEN}")
    assert code == 400 and ended == []


def test_a_request_is_written_once_and_only_for_this_attempt(tmp_path: Path) -> None:
    ep, _ = endpoint(tmp_path, attempt=2)
    assert ask(ep, HeartbeatAsk(attempt=1, checkpoint_request="old")).request_seen is None
    assert slots.read_request(tmp_path) is None
    first = ask(ep, HeartbeatAsk(attempt=2, checkpoint_request="2-ScaleUp-9"))
    assert first.request_seen == "2-ScaleUp-9" == slots.read_request(tmp_path)
    stamp = slots.request_path(tmp_path).stat().st_mtime_ns
    assert ask(ep, HeartbeatAsk(attempt=2, checkpoint_request="2-ScaleUp-9")).request_seen
    assert slots.request_path(tmp_path).stat().st_mtime_ns == stamp, "written once"


def test_a_request_already_in_the_root_is_known_at_start(tmp_path: Path) -> None:
    slots.write_request(tmp_path, "r-7")
    ep, _ = endpoint(tmp_path)
    assert ep.request_seen == "r-7"


def test_the_attempt_ends_once_when_told_or_when_a_newer_one_asks(tmp_path: Path) -> None:
    ep, ended = endpoint(tmp_path, attempt=2)
    ask(ep, HeartbeatAsk(attempt=2))
    assert ended == []
    ask(ep, HeartbeatAsk(attempt=2, ended=True))
    ask(ep, HeartbeatAsk(attempt=3))
    assert ended == [2] and ep.ended


def assignment(attempt: int, node_rank: int = 0, world_size: int = 2) -> Assignment:
    return Assignment(
        attempt=attempt,
        node_rank=node_rank,
        world_size=world_size,
        nproc_per_node=1,
        master_addr="demo-0.demo.ml.svc",
        master_port=29500 + attempt,
    )


def test_a_newer_assignment_restarts_the_worker_in_place(tmp_path: Path) -> None:
    """A pod kept from attempt 2 is assigned attempt 3: attempt 2 ends once, its trainers'
    pulses and its checkpoint request go (the new worker must neither read as hung nor
    stop at once), the assignment is written for the launcher, and the reply serves
    attempt 3 and its node rank. The same assignment again changes nothing."""
    launch = tmp_path / "launch"
    ep, ended = endpoint(tmp_path, attempt=2, node_rank=1, launch=launch)
    ask(ep, HeartbeatAsk(attempt=2, checkpoint_request="2-ScaleUp-9"))
    for rank in (2, 3):
        pulse_path(tmp_path, rank).write_bytes(b"7\n")
    (tmp_path / "alive-dir").mkdir()  # not a pulse file: left alone
    (tmp_path / "keep").write_bytes(b"not a pulse")
    assert slots.read_request(tmp_path) == "2-ScaleUp-9"

    new = assignment(3, node_rank=0)
    reply = ask(ep, HeartbeatAsk(attempt=3, assignment=new))
    assert (reply.attempt, reply.node_rank, reply.request_seen) == (3, 0, None)
    assert ended == [2] and not ep.ended
    assert Assignment.decode((launch / ASSIGNMENT_FILE).read_bytes()) == new
    assert sorted(p.name for p in tmp_path.glob("alive-*")) == ["alive-dir"]
    assert (tmp_path / "keep").exists()
    assert slots.read_request(tmp_path) is None and ep.request_seen is None
    assert reply.trainer_silent_s is None, "the old worker's pulses are gone"

    written = (launch / ASSIGNMENT_FILE).stat()
    pulse_path(tmp_path, 2).write_bytes(b"1\n")  # the new worker's pulse
    again = ask(ep, HeartbeatAsk(attempt=3, assignment=new, checkpoint_request="3-ScaleUp-1"))
    assert (again.attempt, again.node_rank, again.request_seen) == (3, 0, "3-ScaleUp-1")
    assert ended == [2], "attempt 2 ends once"
    after = (launch / ASSIGNMENT_FILE).stat()
    assert (after.st_ino, after.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert pulse_path(tmp_path, 2).exists(), "the new worker's pulse is kept"
    assert slots.read_request(tmp_path) == "3-ScaleUp-1"
    assert LastCheckpoint.decode(again.last_checkpoint) is None  # nothing committed yet

    ask(ep, HeartbeatAsk(attempt=3, ended=True, assignment=new))
    assert ended == [2, 3] and ep.ended


def test_an_older_assignment_or_ask_changes_nothing(tmp_path: Path) -> None:
    """An ask older than the attempt served (a stale view of the job) neither moves the
    pod back nor ends the attempt it serves."""
    launch = tmp_path / "launch"
    ep, ended = endpoint(tmp_path, attempt=4, node_rank=1, launch=launch)
    pulse_path(tmp_path, 1).write_bytes(b"1\n")
    for body in (
        HeartbeatAsk(attempt=3, assignment=assignment(3, node_rank=0)),
        HeartbeatAsk(attempt=3, ended=True, assignment=assignment(3, node_rank=0)),
        HeartbeatAsk(attempt=4, assignment=assignment(4, node_rank=0)),  # served: no-op
    ):
        reply = ask(ep, body)
        assert (reply.attempt, reply.node_rank) == (4, 1)
    assert ended == [] and not (launch / ASSIGNMENT_FILE).exists()
    assert pulse_path(tmp_path, 1).exists()


def test_a_newer_ask_without_a_launch_dir_ends_the_attempt_but_is_not_relayed(
    tmp_path: Path,
) -> None:
    ep, ended = endpoint(tmp_path, attempt=2, launch=None)
    pulse_path(tmp_path, 0).write_bytes(b"1\n")
    reply = ask(ep, HeartbeatAsk(attempt=3, assignment=assignment(3, node_rank=1)))
    assert (reply.attempt, reply.node_rank, reply.worker_exit) == (2, 0, None)
    assert ended == [2] and pulse_path(tmp_path, 0).exists()


def test_an_assignment_that_cannot_be_written_is_not_adopted(tmp_path: Path) -> None:
    """A file where the launch directory should be: the old attempt ends (the operator
    said so), the pod keeps serving it and the operator asks again; once it can be
    written, the assignment is adopted (attempt 2 still ends once)."""
    launch = tmp_path / "launch"
    launch.write_bytes(b"in the way")
    ep, ended = endpoint(tmp_path, attempt=2, node_rank=1, launch=launch)
    new = assignment(3, node_rank=0)
    for _ in range(2):
        reply = ask(ep, HeartbeatAsk(attempt=3, assignment=new))
        assert (reply.attempt, reply.node_rank) == (2, 1)
    assert ended == [2]
    launch.unlink()
    reply = ask(ep, HeartbeatAsk(attempt=3, assignment=new))
    assert (reply.attempt, reply.node_rank) == (3, 0) and ended == [2]
    assert Assignment.decode((launch / ASSIGNMENT_FILE).read_bytes()) == new


def test_the_reply_reports_the_served_attempts_worker_exit(tmp_path: Path) -> None:
    launch = tmp_path / "launch"
    launch.mkdir()
    ep, _ = endpoint(tmp_path, attempt=2, launch=launch)
    path = launch / EXIT_FILE
    assert ask(ep, HeartbeatAsk(attempt=2)).worker_exit is None, "no file: running"
    write_atomic(path, WorkerExit(attempt=2, code=1).encode())
    assert ask(ep, HeartbeatAsk(attempt=2)).worker_exit == 1
    write_atomic(path, WorkerExit(attempt=2, code=-9).encode())
    assert ask(ep, HeartbeatAsk(attempt=2)).worker_exit == -9
    write_atomic(path, WorkerExit(attempt=1, code=3).encode())
    assert ask(ep, HeartbeatAsk(attempt=2)).worker_exit is None, "another attempt's exit"
    # after an in-place restart, the old attempt's exit is not the new one's
    write_atomic(path, WorkerExit(attempt=2, code=1).encode())
    reply = ask(ep, HeartbeatAsk(attempt=3, assignment=assignment(3)))
    assert reply.attempt == 3 and reply.worker_exit is None
    write_atomic(path, WorkerExit(attempt=3, code=2).encode())
    assert ask(ep, HeartbeatAsk(attempt=3)).worker_exit == 2


def test_a_malformed_or_hostile_exit_file_is_no_exit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage, a link (to a valid file), an oversized file, a FIFO, a directory: no exit
    reported, the reply still made, and one warning per distinct trouble, not per beat."""
    launch = tmp_path / "launch"
    launch.mkdir()
    ep, _ = endpoint(tmp_path, attempt=2, launch=launch)
    path = launch / EXIT_FILE
    target = tmp_path / "valid-exit"
    target.write_bytes(WorkerExit(attempt=2, code=1).encode())

    def garbage() -> None:
        path.write_bytes(b"not json")

    def wrong_types() -> None:
        path.write_bytes(b'{"attempt": 2, "code": true}')

    def link() -> None:
        path.symlink_to(target)

    def big() -> None:
        path.write_bytes(b'{"attempt": 2, "code": 1' + b" " * 10_000 + b"}")

    def fifo() -> None:
        os.mkfifo(path)

    def directory() -> None:
        path.mkdir()

    for make in (garbage, fifo, wrong_types, directory, link, big):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
        make()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ctj.heartbeat"):
            for _ in range(3):
                assert ask(ep, HeartbeatAsk(attempt=2)).worker_exit is None, make.__name__
        assert len(caplog.records) == 1, (make.__name__, caplog.records)


def test_the_reply_says_how_long_the_pods_trainers_have_not_run(tmp_path: Path) -> None:
    """No pulse yet: None (a trainer still importing is not judged); a pulse: its silence,
    which grows while the pulse does not change."""
    ep, _ = endpoint(tmp_path)
    assert ask(ep, HeartbeatAsk(attempt=2)).trainer_silent_s is None
    pulse_path(tmp_path, 0).write_bytes(b"1\n")
    first = ask(ep, HeartbeatAsk(attempt=2)).trainer_silent_s
    assert first is not None and first < 0.5
    time.sleep(0.05)
    later = ask(ep, HeartbeatAsk(attempt=2)).trainer_silent_s
    assert later is not None and later >= first + 0.04


def test_only_rank_0_reports_the_last_checkpoint(tmp_path: Path) -> None:
    ep0, _ = endpoint(tmp_path, node_rank=0, latest=Commit(step=40))
    reply = ask(ep0, HeartbeatAsk(attempt=2))
    assert LastCheckpoint.decode(reply.last_checkpoint) == LastCheckpoint(
        40, "2026-12-01T12:00:00Z", 4096
    )
    for rank in (1, None):
        other, _ = endpoint(tmp_path, node_rank=rank, latest=Commit(step=40))
        assert ask(other, HeartbeatAsk(attempt=2)).last_checkpoint is None
    nothing, _ = endpoint(tmp_path, node_rank=0, latest=None)
    assert ask(nothing, HeartbeatAsk(attempt=2)).last_checkpoint is None


def test_settings_from_the_environment() -> None:
    assert hb.HeartbeatSettings.from_env({}) is None
    found = hb.HeartbeatSettings.from_env(
        {"CTJ_CACHE_TOKEN": TOKEN, "CTJ_ATTEMPT": "4", "NODE_RANK": "1"}
    )
    assert found == hb.HeartbeatSettings(token=TOKEN, attempt=4, node_rank=1)
    worker = hb.HeartbeatSettings.from_env({"CTJ_CACHE_TOKEN": TOKEN, "CTJ_ATTEMPT": "4"})
    assert worker is not None and worker.node_rank is None
    with pytest.raises(CheckpointError, match="NODE_RANK='x' is not an integer"):
        hb.HeartbeatSettings.from_env({"CTJ_CACHE_TOKEN": TOKEN, "NODE_RANK": "x"})


# -- the operator's channel against a real sidecar server ------------------------------------


def _serve(ep: hb.HeartbeatEndpoint) -> tuple[str, int, object]:
    server = serve(
        0, CheckpointMetrics(), host="127.0.0.1", post_routes={HEARTBEAT_PATH: ep.handle}
    )
    return "127.0.0.1", server.server_address[1], server


def test_the_channel_asks_a_sidecar_and_marks_its_beat(tmp_path: Path) -> None:
    """A real ask over HTTP: the job's token (derived as the operator derives it), the
    request delivered, rank 0's report kept; a sidecar of another attempt is no beat."""
    channel = HeartbeatChannel(b"k" * 32, Freshness())
    token = channel.token(("ml", "demo"), "u-1")
    settings = hb.HeartbeatSettings(token=token, attempt=2, node_rank=0)
    ep = hb.HeartbeatEndpoint(settings, latest=lambda: Commit(step=60), root=tmp_path)
    host, port, server = _serve(ep)
    channel.port = port
    channel.track("ml", "demo", {"name": "demo-a2-0", "phase": "Running", "ip": host,
                                 "attempt": 2, "rank": 0})  # fmt: skip
    key = ("ml", "demo-a2-0")
    assert channel.beats.silent_for(key) is None, "not heard yet: no beat"
    assert channel.tracked.silent_for(key) is not None, "first seen Running: tracked since"
    job = JobAsk(uid="u-1", attempt=2, ended=False, request="2-NodeDrained-5", period_s=1.0)
    stale = Rank(("ml", "demo"), "demo-a2-0", host, 1, 0)  # as if the IP were reused

    async def run() -> tuple[bool, bool, bool]:
        ok = await channel.ask(key, channel.ranks[key], job)
        other = await channel.ask(key, stale, job)
        wrong = HeartbeatChannel(b"x" * 32, Freshness(), port=port)
        refused = await wrong.ask(key, channel.ranks[key], job)
        return ok, other, refused

    try:
        ok, other, refused = asyncio.run(run())
    finally:
        server.shutdown()  # type: ignore[attr-defined]
    assert ok and not other and not refused
    assert slots.read_request(tmp_path) == "2-NodeDrained-5"
    assert channel.last_checkpoint(("ml", "demo")) == {
        "step": 60, "time": "2026-12-01T12:00:00Z", "bytes": 4096
    }  # fmt: skip


def test_the_channel_keeps_what_the_sidecar_says_of_its_trainers(tmp_path: Path) -> None:
    """A pulse in the pod's staging root: the channel keeps its silence for the decisions;
    the pulse gone (the trainer finished), nothing is kept; untracked, nothing either."""
    trainers: dict[tuple[str, str], float] = {}
    channel = HeartbeatChannel(b"k" * 32, Freshness(), trainers=trainers)
    token = channel.token(("ml", "demo"), "u-1")
    settings = hb.HeartbeatSettings(token=token, attempt=1, node_rank=0)
    host, port, server = _serve(hb.HeartbeatEndpoint(settings, latest=lambda: None, root=tmp_path))
    channel.port = port
    channel.track("ml", "demo", {"name": "p", "phase": "Running", "ip": host,
                                 "attempt": 1, "rank": 0})  # fmt: skip
    key = ("ml", "p")
    job = JobAsk(uid="u-1", attempt=1, ended=False, request=None, period_s=1.0)

    def ask() -> None:
        assert asyncio.run(channel.ask(key, channel.ranks[key], job))

    try:
        ask()
        assert key not in trainers, "no pulse: nothing to judge"
        pulse_path(tmp_path, 0).write_bytes(b"1\n")
        ask()
        time.sleep(0.05)
        ask()
        assert 0.04 <= trainers[key] < 5
        pulse_path(tmp_path, 0).unlink()
        ask()
        assert key not in trainers
        pulse_path(tmp_path, 0).write_bytes(b"2\n")
        ask()
        channel.untrack("ml", "p")
        assert key not in trainers
    finally:
        server.shutdown()  # type: ignore[attr-defined]


def test_the_operators_own_stall_is_not_held_against_the_ranks() -> None:
    """The loop that asks was blocked for 0.4 s: a rank's silence grows by the tick's time
    at most, during the stall and after it; then it grows with the clock again."""
    clock = LoopClock(tick_s=0.01, slack_s=0.05)
    beats = Freshness(clock)
    clock.tick()
    beats.see("rank", 1)
    time.sleep(0.4)  # nothing ticks: this process did not run its asks
    during = beats.silent_for("rank")
    assert during is not None and during < 0.1, during
    clock.tick()
    after = beats.silent_for("rank")
    assert after is not None and after < 0.1, after
    for _ in range(10):
        time.sleep(0.02)
        clock.tick()
    later = beats.silent_for("rank")
    assert later is not None and later >= after + 0.15, (after, later)


def test_an_unanswered_rank_goes_silent_from_when_it_was_first_seen() -> None:
    """Nothing listens at the rank's address (its node is gone): no beat is marked, so the
    decisions see it unanswered since it was tracked, and judge it after the startup
    grace (a rank that answered before is judged after the timeout from that answer)."""
    channel = HeartbeatChannel(b"k" * 32, Freshness(), port=9)  # discard: nothing answers
    channel.track("ml", "demo", {"name": "p", "phase": "Running", "ip": "127.0.0.1",
                                 "attempt": 1, "rank": 0})  # fmt: skip
    key = ("ml", "p")
    job = JobAsk(uid="u", attempt=1, ended=False, request=None, period_s=0.2)

    async def run() -> bool:
        return await channel.ask(key, channel.ranks[key], job)

    assert not asyncio.run(run())
    assert channel.beats.changed_at(key) is None
    assert channel.tracked.changed_at(key) is not None
    channel.untrack("ml", "p")
    assert channel.tracked.changed_at(key) is None


def test_an_older_attempt_is_told_it_ended_and_gets_no_request() -> None:
    job = JobAsk(uid="u", attempt=3, ended=False, request="3-ScaleUp-1", period_s=2.0)
    old = Rank(("ml", "demo"), "demo-a2-0", "10.0.0.1", 2, 0)
    now = Rank(("ml", "demo"), "demo-a3-0", "10.0.0.2", 3, 0)
    assert job.ask_for(old) == HeartbeatAsk(attempt=3, ended=True, checkpoint_request=None)
    assert job.ask_for(now) == HeartbeatAsk(
        attempt=3, ended=False, checkpoint_request="3-ScaleUp-1"
    )


def test_a_pod_not_running_is_not_asked() -> None:
    channel = HeartbeatChannel(b"k" * 32, Freshness())
    summary = {"name": "p", "phase": "Running", "ip": "10.0.0.1", "attempt": 1, "rank": 0}
    channel.track("ml", "demo", summary)
    assert ("ml", "p") in channel.ranks
    channel.track("ml", "demo", {**summary, "phase": "Failed"})
    assert ("ml", "p") not in channel.ranks
    channel.track("ml", "demo", {**summary, "ip": None})
    assert ("ml", "p") not in channel.ranks


def test_the_heartbeat_module_imports_neither_torch_nor_kubernetes() -> None:
    code = (
        "import sys, trainer_sidecar.heartbeat, trainer_sidecar.sidecar;"
        "print(sorted(m for m in ('torch', 'kubernetes') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# -- the trainer's side, and the persister's accessor ------------------------------------------


def test_a_request_file_is_a_preemption_request(tmp_path: Path) -> None:
    from trainer_sidecar import CheckpointConfig, Checkpointer

    ckpt = Checkpointer(
        CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(tmp_path / "stage"))
    )
    assert not ckpt.preemption_requested() and ckpt.checkpoint_request() is None
    ckpt.root.mkdir(parents=True)
    slots.write_request(ckpt.root, "resize-3")
    assert ckpt.preemption_requested() and ckpt.checkpoint_request() == "resize-3"


def test_the_persister_knows_its_latest_commit(tmp_path: Path) -> None:
    import torch

    from trainer_sidecar import CheckpointConfig, Checkpointer

    config = CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(tmp_path / "stage"))
    with Checkpointer(config) as ckpt:
        model = torch.nn.Linear(4, 4)
        ckpt.save(3, model=model).result()  # type: ignore[union-attr]
        persister = ckpt._persister
        assert persister is not None
        latest = persister.latest_committed()
        assert latest is not None and latest.step == 3 and latest.logical_bytes > 0
    from trainer_sidecar.save.persist import Persister

    fresh = Persister(ckpt.store, config, root=ckpt.root, metrics=CheckpointMetrics())
    assert fresh.latest_committed() is None
    fresh.publish_latest()  # what a restarted sidecar finds committed
    found = fresh.latest_committed()
    assert found is not None and found.step == 3


def test_a_commit_waiting_for_parts_stops_when_its_attempt_ends(tmp_path: Path) -> None:
    """Rank 1's node is gone: its part never comes. Once the operator has ended attempt 3,
    rank 0's commit of an attempt-3 save stops waiting (not the 600 s commit timeout), and
    so does one of an older attempt, or of an attempt that is no number (as before: over
    once any attempt ended). A save of attempt 4 (the worker restarted in place) is not
    stopped by attempt 3's end: it waits for its parts up to its commit timeout."""
    from trainer_sidecar import CheckpointConfig
    from trainer_sidecar.errors import SaveFailed
    from trainer_sidecar.format.manifest import SaveIdentity
    from trainer_sidecar.save.persist import Persister
    from trainer_sidecar.store.s3 import open_store

    config = CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(tmp_path / "s"))
    persister = Persister(
        open_store(config.uri), config, root=tmp_path / "s", metrics=CheckpointMetrics()
    )

    def staged(attempt: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            step=20, save=SaveIdentity(attempt, "0123456789abcdef"), world_size=2
        )

    threading.Timer(0.2, persister.attempt_ended, args=(3,)).start()
    started = time.monotonic()
    with pytest.raises(SaveFailed, match=r"attempt ended .* 0 of 2 ranks uploaded"):
        persister._wait_for_parts(staged("3"))  # type: ignore[arg-type]
    assert time.monotonic() - started < config.commit_timeout_s / 10
    persister.attempt_ended(2)  # an older attempt's end, later: attempt 3 is still over
    for attempt in ("3", "2", "a1"):
        with pytest.raises(SaveFailed, match=r"attempt ended"):
            persister._wait_for_parts(staged(attempt))  # type: ignore[arg-type]

    persister.config = dataclasses.replace(config, commit_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(SaveFailed, match=r"only 0 of 2 ranks uploaded within"):
        persister._wait_for_parts(staged("4"))  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.3, "waited for its parts"
