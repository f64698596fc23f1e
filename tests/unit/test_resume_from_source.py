"""spec.checkpoint.resumeFrom, the trainer's half: which location a job's name resolves to
(every ``<name>-<uid>`` it had, the newest commit among them), what happens with two
candidates or none, and that the source is only ever read. Real checkpoints in real
``file://`` locations; test_resume_from.py does it on S3 across world sizes."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from trainer_sidecar import CheckpointConfig, Checkpointer, CheckpointError
from trainer_sidecar.load.resume import (
    FIELD,
    Candidate,
    ReadOnlyStore,
    ResumeSourceError,
    Seed,
    choose,
    job_locations,
    resolve,
)
from trainer_sidecar.store.local import LocalStore

UID = "0b6f2d3a-5c1e-4f7a-9d2b-3e4f5a6b7c8d"


@pytest.mark.parametrize(
    ("entry", "taken"),
    [
        (f"train-{UID}", True),
        (f"train-2-{UID}", False),  # job train-2, not train
        (f"trainer-{UID}", False),
        (f"train-{UID.upper()}", False),  # no Kubernetes uid
        (f"train-{UID}-x", False),
        ("train-", False),
        ("train", False),
        (f"x-train-{UID}", False),
    ],
)
def test_a_name_takes_exactly_its_own_locations(entry: str, taken: bool) -> None:
    assert job_locations([entry, "unrelated"], "train") == ([entry] if taken else [])


def test_a_dotted_name_takes_its_locations_too() -> None:
    assert job_locations([f"a.b-{UID}", f"a-b-{UID}"], "a.b") == [f"a.b-{UID}"]


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        ([Candidate("a", 500, 10.0), Candidate("b", 20, 30.0)], "b"),  # newer commit, lower step
        ([Candidate("a", 500, 30.0), Candidate("b", 20, 10.0)], "a"),
        ([Candidate("a", 5, 10.0), Candidate("b", 7, 10.0)], "b"),  # a tie: the higher step
        ([Candidate("a"), Candidate("b", 7, 10.0)], "b"),  # one without a commit
        ([Candidate("b", 7, 10.0)], "b"),
    ],
)
def test_the_newest_commit_by_commit_time_wins(candidates: list[Candidate], chosen: str) -> None:
    seed = choose(candidates, wanted="job 'train'")
    assert seed.uri == chosen
    assert {c.uri for c in seed.others} == {c.uri for c in candidates} - {chosen}


def test_no_commit_anywhere_is_an_error_naming_the_field_and_what_was_looked_at() -> None:
    with pytest.raises(ResumeSourceError) as info:
        choose([Candidate("s3://b/p/ml/train-1"), Candidate("s3://b/p/ml/train-2")], wanted="x")
    message = str(info.value)
    assert message.startswith(FIELD) and "spec.checkpoint.resumeFrom" in message
    assert "2 location(s) without a committed checkpoint" in message
    assert "s3://b/p/ml/train-1, s3://b/p/ml/train-2" in message
    assert "remove resumeFrom to start from step 0" in message
    with pytest.raises(ResumeSourceError, match="found no location"):
        choose([], wanted="x")


def test_the_source_store_refuses_every_write(tmp_path: Path) -> None:
    inner = LocalStore(tmp_path)
    inner.put("manifests/1.json", b"{}")
    store = ReadOnlyStore(inner, "file:///src")
    assert store.get("manifests/1.json") == b"{}"
    assert [o.key for o in store.list("manifests/")] == ["manifests/1.json"]
    with pytest.raises(CheckpointError, match="resume source: read-only"):
        store.put("manifests/2.json", b"{}")
    with pytest.raises(CheckpointError, match="resume source: read-only"):
        store.delete(["manifests/1.json"])
    assert [o.key for o in inner.list("")] == ["manifests/1.json"]


def commit(uri: str, *steps: int) -> None:
    with Checkpointer(CheckpointConfig(uri=uri, keep_last=0)) as ckpt:
        for step in steps:
            pending = ckpt.save(step, model=torch.nn.Linear(4, 2), extra={"step": step})
            assert pending is not None
            pending.result()


def location(root: Path, name: str) -> str:
    return f"file://{root}/ml/{name}-{uuid.uuid4()}"


def config(own: str, resume_from: str, job: str | None = None) -> CheckpointConfig:
    return CheckpointConfig(uri=own, resume_from=resume_from, resume_from_job=job)


def test_a_name_resolves_to_the_newest_commit_across_its_uids(tmp_path: Path) -> None:
    """train ran twice (two uids), then was re-created a third time with resumeFrom: train.
    The second run's commit is the newest, though the first ran to a higher step; a job
    whose name only starts the same (train-2) and the new job's own location are not
    candidates."""
    first, second = location(tmp_path, "train"), location(tmp_path, "train")
    commit(first, 400, 500)
    commit(second, 30)
    commit(location(tmp_path, "train-2"), 900)
    own = location(tmp_path, "train")
    LocalStore(own.removeprefix("file://"))  # it exists (its sidecar made it), empty
    seed = resolve(config(own, f"file://{tmp_path}/ml", "train"))
    assert seed == Seed(second, 30, (Candidate(first, 500, seed.others[0].committed_at),))


def test_a_location_of_a_name_without_a_commit_is_passed_over(tmp_path: Path) -> None:
    first, failed_early = location(tmp_path, "train"), location(tmp_path, "train")
    commit(first, 100)
    LocalStore(failed_early.removeprefix("file://"))  # ran, never committed
    own = location(tmp_path, "train")
    assert resolve(config(own, f"file://{tmp_path}/ml", "train")).uri == first


def test_a_name_with_no_location_or_no_commit_is_an_error_not_a_start_from_0(
    tmp_path: Path,
) -> None:
    own = location(tmp_path, "new")
    with pytest.raises(ResumeSourceError) as info:
        resolve(config(own, f"file://{tmp_path}/ml", "train"))
    assert "job 'train'" in str(info.value) and "found no location" in str(info.value)
    empty = location(tmp_path, "train")
    LocalStore(empty.removeprefix("file://"))
    with pytest.raises(ResumeSourceError, match="1 location.s. without a committed checkpoint"):
        resolve(config(own, f"file://{tmp_path}/ml", "train"))
    # a directory of locations that does not exist: none, and it is not created
    with pytest.raises(ResumeSourceError, match="found no location"):
        resolve(config(own, f"file://{tmp_path}/elsewhere", "train"))
    assert not (tmp_path / "elsewhere").exists()


def test_a_location_is_read_as_given(tmp_path: Path) -> None:
    source = location(tmp_path, "train")
    commit(source, 7, 8)
    own = location(tmp_path, "moved")
    assert resolve(config(own, source)) == Seed(source, 8)
    with pytest.raises(ResumeSourceError, match="this job's own location"):
        resolve(config(source, source + "/"))
    missing = f"file://{tmp_path}/ml/gone"
    with pytest.raises(ResumeSourceError, match="does not exist"):
        resolve(config(own, missing))
    assert not (tmp_path / "ml" / "gone").exists()  # a source is never created


def test_the_settings_from_the_environment_name_their_variable() -> None:
    base = {"CTJ_CHECKPOINT_URI": "s3://b/p/ml/new-x"}
    with pytest.raises(CheckpointError, match="CTJ_RESUME_FROM_JOB"):
        CheckpointConfig.from_env({**base, "CTJ_RESUME_FROM_JOB": "train"})  # no directory
    with pytest.raises(CheckpointError, match="CTJ_RESUME_FROM_JOB"):
        CheckpointConfig.from_env(
            {**base, "CTJ_RESUME_FROM": "s3://b/p/ml", "CTJ_RESUME_FROM_JOB": "Train_1"}
        )
    with pytest.raises(CheckpointError, match="CTJ_RESUME_FROM: .*scheme without"):
        CheckpointConfig.from_env({**base, "CTJ_RESUME_FROM": "s3:/b/p"})
    assert CheckpointConfig.from_env(base).resume_from is None
