"""A run that starts below the steps its location holds: refused at its first save, with
the fixes named (load to resume; a new URI for a new run; ``ctj checkpoints rm`` to go
back on purpose), so no commit it reports is ever retired by the steps above it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration.ranks import run_ranks
from trainer_sidecar import CheckpointConfig, Checkpointer, CheckpointError
from trainer_sidecar.cli import main
from trainer_sidecar.format.manifest import PARTS
from trainer_sidecar.store import repository as repo

pytestmark = pytest.mark.integration


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))


def test_a_new_run_below_the_stored_steps_is_refused_until_it_resumes(s3_uri: str) -> None:
    config = CheckpointConfig(uri=s3_uri, mode="full", keep_last=3)
    with Checkpointer(config) as old:
        for step in (500, 501, 502):
            old.save(step, model=model(0)).result()  # type: ignore[union-attr]
        store = old.store

    with Checkpointer(config) as new:  # a new run at the same URI, no load
        with pytest.raises(CheckpointError) as info:
            new.save(10, model=model(1))
        message = str(info.value)
        assert "step 10 is below the checkpoints at" in message and s3_uri in message
        assert "(steps 500, 501, 502)" in message, message
        assert "call load() before training" in message and "a new URI" in message, message
        assert f"ctj checkpoints rm {s3_uri} 500 501 502" in message, message
        assert repo.committed_steps(store) == [500, 501, 502]
        assert list(store.list(PARTS)) == []  # nothing staged, nothing uploaded
        with pytest.raises(CheckpointError, match="step 11 is below"):
            new.save(11, model=model(1))  # still refused: it has not resumed

    with Checkpointer(config) as resumed:  # what the message says: load, go on from there
        net = model(2)
        restored = resumed.load(model=net)
        assert restored is not None and restored.step == 502
        assert resumed.save(503, model=net).result().step == 503  # type: ignore[union-attr]
    assert repo.committed_steps(store) == [501, 502, 503]

    # going back on purpose: the later steps removed first, then a low step is kept
    assert main(["checkpoints", "rm", s3_uri, "501", "502", "503"]) == 0
    with Checkpointer(config) as again:
        assert again.save(10, model=model(3)).result().step == 10  # type: ignore[union-attr]
        assert again.save(11, model=model(3)).result().step == 11  # type: ignore[union-attr]
    assert repo.committed_steps(store) == [10, 11]


def refused_on_every_rank(args: dict[str, Any]) -> None:
    """A rank of a 2-rank run started below the stored steps: every rank gets the same
    refusal (none is left waiting in a collective), then resumes with load()."""
    import torch.distributed as dist

    config = CheckpointConfig(uri=args["uri"], mode="full", keep_last=0)
    with Checkpointer(config) as ckpt:
        net = model(dist.get_rank())
        with pytest.raises(CheckpointError, match=r"step 10 is below .* \(steps 500\)"):
            ckpt.save(10, model=net)
        restored = ckpt.load(model=net)
        assert restored is not None and restored.step == 500
        assert ckpt.save(501, model=net).result().step == 501  # type: ignore[union-attr]


def test_every_rank_is_refused_alike(s3_uri: str) -> None:
    with Checkpointer(CheckpointConfig(uri=s3_uri, mode="full", keep_last=0)) as old:
        old.save(500, model=model(0)).result()  # type: ignore[union-attr]
        store = old.store
    run_ranks(2, "tests.integration.test_start_step:refused_on_every_rank", {"uri": s3_uri})
    assert repo.committed_steps(store) == [500, 501]


def test_a_run_that_fell_back_past_a_corrupt_newest_checkpoint_still_saves(s3_uri: str) -> None:
    """load() skipped steps 20 and 30 (corrupt) for step 10: the run resumed from there, so
    its next save (11) is not refused for the steps above it."""
    config = CheckpointConfig(uri=s3_uri, mode="full", keep_last=0)
    with Checkpointer(config) as old:
        for step in (10, 20, 30):
            old.save(step, model=model(0)).result()  # type: ignore[union-attr]
        store = old.store
    for step in (20, 30):
        key = repo.read_manifest(store, step).ranks[0].key
        store.put(key, store.get(key) + b" ")  # its rank manifest fails its hash check
    with Checkpointer(config) as resumed:
        net = model(1)
        restored = resumed.load(model=net)
        assert restored is not None and restored.step == 10
        assert resumed.save(11, model=net).result().step == 11  # type: ignore[union-attr]
