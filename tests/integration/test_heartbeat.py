"""The real sidecar process answers the operator's real heartbeat channel over loopback:
the channel marks its beats, rank 0 reports its commit, a checkpoint request reaches the
trainer, an ask without the job's token changes nothing, the attempt's end reaches the
persister, and the sidecar answers through its SIGTERM grace until it exits 0."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ctj_contract import Env
from ctj_operator.heartbeats import HeartbeatChannel, JobAsk
from ctj_operator.observe import Freshness

from tests.integration.ranks import run_ranks
from tests.integration.test_sidecar import Sidecar, big_model, sidecar_config, wait_until
from trainer_sidecar import Checkpointer
from trainer_sidecar.config import job_staging_dir
from trainer_sidecar.store import repository as repo

KEY = b"k" * 32
JOB = ("ml", "demo")
UID = "u-1"
POD = ("ml", "demo-a1-0")


class Operator:
    """The operator's channel on an event loop of its own thread, as kopf runs it."""

    def __init__(self, port: int) -> None:
        self.channel = HeartbeatChannel(KEY, Freshness(), port=port)
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task[None] | None = None
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(5)

    async def _start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.channel.run(lambda: True))

    def want(self, *, ended: bool = False, request: str | None = None) -> None:
        ask = JobAsk(uid=UID, attempt=1, ended=ended, request=request, period_s=0.2)
        self.channel.want(JOB, ask)

    def beats(self) -> int:
        return self.channel._answers

    def stop(self) -> None:
        if self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def rank0_env(monkeypatch: pytest.MonkeyPatch) -> str:
    """What the operator gives rank 0's sidecar (Sidecar passes our environment on)."""
    token = HeartbeatChannel(KEY, Freshness()).token(JOB, UID)
    monkeypatch.setenv(Env.CACHE_TOKEN, token)
    monkeypatch.setenv(Env.ATTEMPT, "1")
    monkeypatch.setenv(Env.NODE_RANK, "0")
    return token


@pytest.fixture
def running(rank0_env: str, s3_uri: str, tmp_path: Path) -> Iterator[tuple[Sidecar, Operator]]:
    sidecar = Sidecar(s3_uri, tmp_path / "staging", tmp_path / "sidecar.log", grace=60)
    op = Operator(sidecar.port)
    op.want()
    op.channel.track("ml", "demo", {"name": POD[1], "phase": "Running", "ip": "127.0.0.1",
                                    "attempt": 1, "rank": 0})  # fmt: skip
    yield sidecar, op
    op.stop()
    if sidecar.proc.poll() is None:
        sidecar.proc.kill()
        sidecar.proc.wait()
    print(f"---- sidecar log (tail) ----\n{sidecar.text()[-4000:]}")


def test_rank0_answers_reports_its_commit_and_takes_checkpoint_requests(
    running: tuple[Sidecar, Operator], s3_uri: str, tmp_path: Path
) -> None:
    sidecar, op = running
    staging = tmp_path / "staging"
    wait_until(lambda: op.beats() >= 3, "three answered asks", 30)
    silent = op.channel.beats.silent_for(POD)
    assert silent is not None and silent < 2.0
    assert op.channel.last_checkpoint(JOB) is None  # nothing committed yet

    # a trainer process (sidecar mode) saves step 3; the sidecar commits it and reports it
    args = {
        "kind": "ddp",
        "uri": s3_uri,
        "step": 3,
        "ref": str(tmp_path / "ref.pt"),
        "config": {"sidecar": True, "staging_dir": str(staging)},
    }
    run_ranks(1, "tests.integration.workers:save", args, timeout=120)
    manifest = repo.latest_manifest(Checkpointer(sidecar_config(s3_uri, staging)).store)
    assert manifest is not None and manifest.step == 3
    wait_until(lambda: op.channel.last_checkpoint(JOB) is not None, "rank 0's report", 30)
    assert op.channel.last_checkpoint(JOB) == {
        "step": 3,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(manifest.created)),
        "bytes": manifest.logical_bytes,
    }

    # the operator asks for a checkpoint: the trainer's next boundary sees it
    trainer = Checkpointer(sidecar_config(s3_uri, staging))
    request = job_staging_dir(trainer.config) / "checkpoint-request"
    assert not trainer.preemption_requested()
    for request_id in ("1-ScaleUp-1", "1-ScaleUp-2"):
        op.want(request=request_id)
        wait_until(
            lambda rid=request_id: request.exists() and request.read_text() == rid,
            f"{request} to hold {request_id}",
            30,
        )
        assert trainer.preemption_requested() and trainer.checkpoint_request() == request_id
    assert request.parent.stat().st_mode & 0o777 == 0o700


def test_a_wrong_token_is_refused_and_the_sidecar_answers_until_it_exits(
    running: tuple[Sidecar, Operator], s3_uri: str, tmp_path: Path
) -> None:
    sidecar, op = running
    wait_until(lambda: op.beats() >= 1, "an answered ask", 30)

    def counted(name: str) -> float:
        text = sidecar.get("/metrics")[1]
        return float(next(x for x in text.splitlines() if x.startswith(f"{name} ")).split()[-1])

    # another key (another cluster's operator, or anyone else): refused, nothing written
    intruder = HeartbeatChannel(b"x" * 32, Freshness(), port=sidecar.port)
    intruder.track("ml", "demo", {"name": POD[1], "phase": "Running", "ip": "127.0.0.1",
                                  "attempt": 1, "rank": 0})  # fmt: skip
    intruder.want(JOB, JobAsk(uid=UID, attempt=1, ended=True, request="x", period_s=0.2))

    async def intrude() -> bool:

        return await intruder.ask(POD, intruder.ranks[POD], intruder.jobs[JOB])

    assert not asyncio.run(intrude())
    assert counted("ctj_heartbeats_refused_total") == 1
    assert not (job_staging_dir(sidecar_config(s3_uri, tmp_path / "staging"))
                / "checkpoint-request").exists()  # fmt: skip
    assert "the operator ended attempt" not in sidecar.text()

    # the operator ends the attempt: the sidecar hears it once
    op.want(ended=True)
    wait_until(lambda: "the operator ended attempt 1" in sidecar.text(), "the end heard", 30)

    # SIGTERM while an upload is in flight: it answers on, commits, reports, exits 0
    trainer = Checkpointer(sidecar_config(s3_uri, tmp_path / "staging"))
    trainer.save(2, model=big_model())
    wait_until(lambda: "uploading step 2" in sidecar.text(), "the upload", 60)
    sidecar.signal(signal.SIGTERM)
    answered = op.beats()
    wait_until(lambda: op.beats() >= answered + 2, "asks answered in the SIGTERM grace", 60)
    assert sidecar.wait() == 0, sidecar.text()
    trainer.close()
    log = sidecar.text()
    order = ["got SIGTERM", "committed step 2", "exiting"]
    assert [log.index(x) for x in order] == sorted(log.index(x) for x in order), log[-3000:]
