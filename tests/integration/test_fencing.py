"""Fencing: a commit takes exactly ranks 0..W-1 of one save of one attempt.

Whatever a second writer at the same URI, a straggler of an earlier attempt, or a
sidecar killed before its commit leaves in the store can never enter a checkpoint:
every committed step loads bitwise as exactly the values of the save its manifest
names (chaos_worker.py makes the values a function of (attempt, step)).

The processes are the chaos test's (test_chaos.py): forked trainer ranks of an
FSDP2-sharded model, one ``ctj sidecar`` process per rank on its own staging dir.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.test_chaos import (
    ChaosFailure,
    Job,
    JobSpec,
    Location,
    SaveReport,
    reports,
    wait_for,
)
from trainer_sidecar.format.manifest import CHUNKS, PARTS, SaveIdentity, part_key

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def _touch(path: Path) -> None:
    path.write_text("")


def _nonce(job: Job, rank: int, step: int) -> str:
    """The save identity's nonce a trainer printed once it staged ``step``."""
    found: list[str] = []

    def staged() -> bool:
        for line in job.trainers[rank].text().splitlines():
            if line.startswith(f"STAGED {step} "):
                found.append(line.split()[2])
                return True
        return False

    wait_for(staged, f"{job.trainers[rank].name} to stage step {step}", 120)
    return found[0]


def _finish(job: Job) -> list[SaveReport]:
    job.wait_trainers(timeout=180)
    if job.sidecars:
        job.stop_sidecars()
    return reports(job.trainers[0].text())


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.cleanup()


def test_two_writers_at_one_uri_commit_each_step_as_exactly_one_of_them(
    s3_uri: str, tmp_path: Path, jobs: list[Job]
) -> None:
    """Two independent 2-rank jobs ("a" in-process persisters, "b" sidecars) save the same
    steps at the same time with different values: each step is one writer's, whole."""
    steps = 5
    sync = tmp_path / "sync"
    sync.mkdir()

    def job(attempt: str, other: str, sidecar: bool) -> Job:
        spec = JobSpec(
            uri=s3_uri, attempt=attempt, world=2, root=tmp_path / attempt, sidecar=sidecar
        )
        # rank 0 stages step s only once the other writer has staged s-1: they race on
        # every step's commit
        lockstep = {"mine": str(sync / attempt), "theirs": str(sync / other)}
        started = Job(spec, {"steps": steps, "sync": lockstep}, trainers=False)
        jobs.append(started)
        return started

    a, b = job("a", "b", sidecar=False), job("b", "a", sidecar=True)
    b.wait_sidecars_ready()
    a.start_trainers()
    b.start_trainers()
    seen = {"a": _finish(a), "b": _finish(b)}

    where = Location(s3_uri, tmp_path / "loader")
    manifests = where.manifests()
    assert sorted(manifests) == list(range(1, steps + 1)), sorted(manifests)
    winners = {s: m.save.attempt for s, m in manifests.items() if m.save}
    for attempt, saves in seen.items():
        assert sorted(r.step for r in saves) == list(range(1, steps + 1)), (attempt, saves)
        for r in saves:
            mine = manifests[r.step].save == SaveIdentity(attempt, r.nonce)
            if r.outcome == "committed":
                assert mine, (
                    f"{attempt} was told step {r.step} committed; the store holds {winners}"
                )
                continue
            assert not mine, f"{attempt}'s save of step {r.step} raised but is the one stored"
            kind, _, message = r.error.partition(": ")
            assert kind == "CommitConflict", r.error
            assert f"step {r.step} was already committed by another save" in message, message
            assert "\n" not in message and "Traceback" not in message, message
    committed = [r for saves in seen.values() for r in saves if r.outcome == "committed"]
    assert len(committed) == steps, (winners, seen)
    where.check(committed, ["a", "b"])  # each step bitwise one writer's; verify; gc
    print(f"winners by step: {winners}")


def _slice_until(job: Job, rank: int, condition: Callable[[], bool], what: str) -> None:
    """Let a stopped sidecar run in slices of a few ms, stopped again after each, until
    ``condition`` (checked while it is stopped, so what it sees stays true)."""
    sidecar = job.sidecars[rank]
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise ChaosFailure("hang", f"timed out waiting for {what}\n{job.tails()}")
        sidecar.signal(signal.SIGCONT)
        time.sleep(0.004)  # one slice of its run: the stepping itself, not a wait
        sidecar.signal(signal.SIGSTOP)
        wait_for(lambda: _stopped(sidecar.pid), f"{sidecar.name} to stop", 10)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_straggler_of_an_old_attempt_never_enters_the_new_commit(
    s3_uri: str, tmp_path: Path, jobs: list[Job]
) -> None:
    """Attempt 1's rank-1 sidecar is frozen mid-upload of step 2; attempt 2 commits step 2;
    the straggler then finishes its part: step 2 stays attempt 2's, gc removes the part."""
    where = Location(s3_uri, tmp_path / "loader")
    gate = tmp_path / "go"
    one = Job(
        JobSpec(
            uri=s3_uri,
            attempt="1",
            world=2,
            root=tmp_path / "one",
            env={"CTJ_CHECKPOINT_PARALLELISM": "1"},  # one chunk at a time: a slow straggler
        ),
        {"steps": 2, "gate": str(gate), "hold": True},
        trainers=False,
    )
    jobs.append(one)
    one.wait_sidecars_ready()
    _touch(Path(f"{gate}.1"))
    one.start_trainers()
    wait_for(lambda: where.has_manifest(1), "attempt 1 to commit step 1", 120)

    straggler = one.sidecars[1]
    wait_for(lambda: one.idle(1), "rank 1's sidecar to release step 1", 30)
    straggler.signal(signal.SIGSTOP)
    wait_for(lambda: _stopped(straggler.pid), "rank 1's sidecar to stop", 10)
    _touch(Path(f"{gate}.2"))
    save = SaveIdentity("1", _nonce(one, 0, 2))
    _nonce(one, 1, 2)
    rank0_part = part_key(2, save, 0)
    wait_for(lambda: rank0_part in where.keys(PARTS), "rank 0's part of step 2", 120)
    # rank 0's sidecar now only polls for parts: every new chunk is rank 1's
    before = where.keys(CHUNKS)
    straggler_part = part_key(2, save, 1)
    _slice_until(
        one, 1, lambda: bool(where.keys(CHUNKS) - before), "rank 1's first chunk of step 2"
    )
    assert straggler_part not in where.keys(PARTS), "rank 1 finished before it could be frozen"
    for p in [*one.trainers, one.sidecars[0]]:
        p.kill()
    wait_for(
        lambda: not any(p.alive() for p in [*one.trainers, one.sidecars[0]]),
        "attempt 1 (but the straggler) to die",
        30,
    )

    two = Job(
        JobSpec(uri=s3_uri, attempt="2", world=2, root=tmp_path / "two"),
        {"steps": 1, "load": True, "expect_attempt": "1"},
    )
    jobs.append(two)
    seen = _finish(two)
    assert [(r.outcome, r.step) for r in seen] == [("committed", 2)], seen
    assert "LOADED 1 1 ok" in two.trainers[0].text()

    straggler.signal(signal.SIGCONT)
    wait_for(lambda: straggler_part in where.keys(PARTS), "the straggler to store its part", 120)
    wait_for(lambda: "rank 1 uploaded step 2" in straggler.text(), "the straggler to finish", 30)
    manifests = where.manifests()
    assert manifests[2].save is not None and manifests[2].save.attempt == "2"
    where.load_exact(manifests[2], others=["1"])
    committed1 = [r for r in reports(one.trainers[0].text()) if r.outcome == "committed"]
    where.check([*committed1, *seen], ["1", "2"])  # gc --grace 0: no part, no orphan chunk left
    assert straggler.alive(), straggler.tail()  # it never noticed: nothing it did mattered


def test_sidecar_killed_after_every_part_before_the_commit_commits_at_restart(
    s3_uri: str, tmp_path: Path, jobs: list[Job]
) -> None:
    """Rank 0's sidecar dies when every part of step 1 is stored but before its commit; a
    new sidecar on the same staging dir commits it (rank 0's slot was kept), and the
    trainers, alive throughout, go on saving."""
    where = Location(s3_uri, tmp_path / "loader")
    job = Job(
        JobSpec(uri=s3_uri, attempt="1", world=2, root=tmp_path), {"steps": 2}, trainers=False
    )
    jobs.append(job)
    job.wait_sidecars_ready()
    first, second = job.sidecars
    second.signal(signal.SIGSTOP)  # rank 1's part waits: rank 0 cannot commit yet
    wait_for(lambda: _stopped(second.pid), "rank 1's sidecar to stop", 10)
    job.start_trainers()
    save = SaveIdentity("1", _nonce(job, 0, 1))
    wait_for(lambda: part_key(1, save, 0) in where.keys(PARTS), "rank 0's part of step 1", 120)
    first.signal(signal.SIGSTOP)
    wait_for(lambda: _stopped(first.pid), "rank 0's sidecar to stop", 10)
    second.signal(signal.SIGCONT)
    wait_for(lambda: part_key(1, save, 1) in where.keys(PARTS), "rank 1's part of step 1", 120)
    assert not where.has_manifest(1), "rank 0's sidecar committed before it was stopped"
    first.kill()  # every part stored, no manifest: the window
    wait_for(lambda: not first.alive(), "rank 0's sidecar to die", 10)
    assert not where.has_manifest(1)
    assert not job.idle(0), "rank 0's slot was released before its commit"
    assert job.idle(1), "rank 1's slot is still staged after its part was stored"

    restarted = job.start_sidecar(0, log_suffix="-restarted")
    wait_for(lambda: where.has_manifest(1), "the restarted sidecar to commit step 1", 120)
    assert where.manifests()[1].save == save
    seen = _finish(job)
    assert [(r.outcome, r.step) for r in seen] == [("committed", 1), ("committed", 2)], seen
    log = restarted.text()
    assert "committed step 1 (" in log, log
    assert "uploading step 1 (rank 0" not in log, "the restarted sidecar uploaded step 1 again"
    where.check(seen, ["1"])
