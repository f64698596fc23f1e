"""spec.checkpoint.resumeFrom on a real S3 server with real gloo ranks: a job re-created
under the same name (a new uid, a new empty location) is seeded from the deleted job's
newest commit, resharded 4 -> 2; the source stays byte for byte what it was; the new job's
saves go to its own location, and its next attempt (at 3) resumes from those, not the
source."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.integration.ranks import run_ranks
from tests.integration.workers import assert_bitwise_equal, build, full_state, train
from trainer_sidecar import CheckpointConfig, Checkpointer, CheckpointError
from trainer_sidecar.load.resume import ResumeSourceError
from trainer_sidecar.parts import job_store
from trainer_sidecar.store import repository as repo

pytestmark = pytest.mark.integration

INTERVAL = 5


def snapshot(uri: str) -> dict[str, tuple[int, float, str]]:
    """Every object at ``uri``: size, Last-Modified and the hash of its bytes."""
    store = job_store(uri)
    return {
        o.key: (o.size, o.last_modified, hashlib.sha256(store.get(o.key)).hexdigest())
        for o in store.list("")
    }


def seeded_run(args: dict[str, Any]) -> None:
    """An attempt of the new job: load (its own checkpoints first, else the source), check
    the state bitwise, save ``args['save']`` and keep what it saved as the next reference."""
    config = CheckpointConfig(
        uri=args["own"], resume_from=args["parent"], resume_from_job=args["name"], keep_last=0
    )
    model, opt = build("fsdp", seed=123)
    extra: dict[str, Any] = {"step": -1}
    with Checkpointer(config) as ckpt:
        result = ckpt.load(model=model, optimizer=opt, extra=extra)
        assert result is not None and result.step == args["step"], result
        assert result.source == args["source"], (result.source, args["source"])
        assert extra == {"step": args["step"]}, extra
        got = full_state(model, opt)
        if dist.get_rank() == 0:
            assert_bitwise_equal(got, torch.load(args["ref"], weights_only=True))
            print(f"restored step {result.step} from {result.source or 'own'} bitwise")
        train(model, opt, 1)
        step = result.step + INTERVAL  # the first save: the restored step + the interval
        pending = ckpt.save(step, model=model, optimizer=opt, extra={"step": step})
        assert pending is not None
        ref = full_state(model, opt)
        assert pending.result().step == step
    if dist.get_rank() == 0:
        torch.save(ref, args["next_ref"])


def seeding_fails(args: dict[str, Any]) -> None:
    """A name with no committed checkpoint: every rank raises the same error, none waits."""
    config = CheckpointConfig(uri=args["own"], resume_from=args["parent"], resume_from_job="gone")
    model, opt = build("fsdp", seed=1)
    with Checkpointer(config) as ckpt:
        with pytest.raises(ResumeSourceError, match=r"spec\.checkpoint\.resumeFrom .*'gone'"):
            ckpt.load(model=model, optimizer=opt)
    print("refused on rank", dist.get_rank())


def test_a_recreated_job_seeds_from_the_deleted_ones_checkpoints_resharded(
    s3_uri: str, tmp_path: Path
) -> None:
    parent = f"{s3_uri}/ml"
    source = f"{parent}/train-{uuid.uuid4()}"  # the deleted job's location
    ref = str(tmp_path / "source.pt")
    run_ranks(
        4, "tests.integration.workers:save", {"kind": "fsdp", "uri": source, "step": 5, "ref": ref}
    )
    before = snapshot(source)
    assert repo.committed_steps(job_store(source)) == [5] and len(before) > 4

    own = f"{parent}/train-{uuid.uuid4()}"  # re-created under the same name: a new uid
    first = {"own": own, "parent": parent, "name": "train", "source": source, "step": 5}
    first.update(ref=ref, next_ref=str(tmp_path / "own10.pt"))
    outputs = run_ranks(2, "tests.integration.test_resume_from:seeded_run", first)
    assert f"restored step 5 from {source} bitwise" in outputs[0]

    assert snapshot(source) == before  # read, never written, retired, fenced or collected
    assert repo.committed_steps(job_store(own)) == [10]

    # the new job's next attempt, at another world size: its own step 10, not the source's 5
    again = {"own": own, "parent": parent, "name": "train", "source": None, "step": 10}
    again.update(ref=first["next_ref"], next_ref=str(tmp_path / "own15.pt"))
    outputs = run_ranks(3, "tests.integration.test_resume_from:seeded_run", again)
    assert "restored step 10 from own bitwise" in outputs[0]
    assert repo.committed_steps(job_store(own)) == [10, 15]
    assert snapshot(source) == before

    # the start-step rule still holds for the job's own location: a run that does not
    # load is refused below its steps, resumeFrom or not
    config = CheckpointConfig(uri=own, resume_from=parent, resume_from_job="train")
    with Checkpointer(config) as late:
        with pytest.raises(CheckpointError, match=r"step 6 is below the checkpoints"):
            late.save(6, model=torch.nn.Linear(4, 2))


def test_a_source_without_a_commit_fails_every_rank_naming_the_field(s3_uri: str) -> None:
    parent = f"{s3_uri}/ml"
    job_store(f"{parent}/gone-{uuid.uuid4()}").put("parts/x", b"")  # a run that never committed
    own = f"{parent}/gone-{uuid.uuid4()}"
    outputs = run_ranks(
        2, "tests.integration.test_resume_from:seeding_fails", {"own": own, "parent": parent}
    )
    assert all("refused on rank" in out for out in outputs)
    assert repo.committed_steps(job_store(own)) == []
