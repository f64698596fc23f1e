"""Exactly-once data across a world-size change: 4 ranks train and checkpoint the sampler
through a real Checkpointer (real S3, real gloo), 3 ranks resume; every sample of the
first N global steps is trained exactly once, by the ranks of one attempt."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.integration.ranks import run_ranks
from tests.integration.workers import build, config
from trainer_sidecar import Checkpointer, GlobalSampler

pytestmark = pytest.mark.integration

LEN, BATCH, SEED = 40, 12, 5  # 3 global steps an epoch (4 samples dropped): rollovers
SAVE_AT, TOTAL = 4, 10  # the checkpoint falls inside epoch 1; the run ends in epoch 3
TARGET = "tests.integration.test_sampler_resume"


def train_and_record(args: dict[str, Any]) -> None:
    """Rank function: resume (if a checkpoint exists), train to args['until'] drawing from a
    GlobalSampler, save at args['save_at'] (if given); each step's indices go to a file."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build("fsdp", seed=0)
    data = torch.randn(LEN, 16, generator=torch.Generator().manual_seed(0))
    sampler = GlobalSampler(LEN, BATCH, rank=rank, world_size=world, seed=SEED)
    ckpt = Checkpointer(config(args))
    extra: dict[str, Any] = {"step": 0, "sampler": sampler.state_dict()}
    restored = ckpt.load(model=model, optimizer=opt, extra=extra)
    if restored is not None:
        assert restored.step == args["resume_from"] == extra["step"], (restored, extra)
        sampler.load_state_dict(extra["sampler"])
        assert sampler.step == extra["step"], (sampler.state_dict(), extra)
    else:
        assert args["resume_from"] is None
    drawn = iter(sampler)
    with open(Path(args["out"]) / f"{args['attempt']}-rank{rank}.jsonl", "w") as out:
        for step in range(sampler.step + 1, args["until"] + 1):
            indices = [next(drawn) for _ in range(sampler.local_batch_size)]
            loss = model(data[indices]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sampler.advance()
            out.write(json.dumps({"step": step, "world": world, "indices": indices}) + "\n")
            if step == args.get("save_at"):
                state = {"step": step, "sampler": sampler.state_dict()}
                pending = ckpt.save(step, model=model, optimizer=opt, extra=state)
                assert pending is not None
                pending.result()
    ckpt.close()


def read_steps(out: Path) -> dict[int, list[tuple[int, list[int]]]]:
    """Global step (1-based) -> (world size, indices) of each rank's record, in rank order."""
    steps: dict[int, list[tuple[int, list[int]]]] = {}
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).append((record["world"], record["indices"]))
    return steps


def test_resume_at_3_ranks_trains_every_sample_of_4_ranks_run_exactly_once(
    s3_uri: str, tmp_path: Path
) -> None:
    common = {"uri": s3_uri, "out": str(tmp_path)}
    run_ranks(
        4,
        f"{TARGET}:train_and_record",
        dict(common, attempt="a1", until=SAVE_AT, save_at=SAVE_AT, resume_from=None),
    )
    run_ranks(
        3,
        f"{TARGET}:train_and_record",
        dict(common, attempt="a2", until=TOTAL, resume_from=SAVE_AT),
    )

    reference = GlobalSampler(LEN, BATCH, rank=0, world_size=1, seed=SEED)
    steps = read_steps(tmp_path)
    assert sorted(steps) == list(range(1, TOTAL + 1)), "every global step trained once"
    for step, records in steps.items():
        world = 4 if step <= SAVE_AT else 3
        assert [w for w, _ in records] == [world] * world, (step, records)
        got = [i for _, indices in records for i in indices]
        assert got == reference.global_batch(step - 1), step  # the ranks' shares, in order
    consumed = Counter(i for records in steps.values() for _, idx in records for i in idx)
    want = Counter(i for step in range(TOTAL) for i in reference.global_batch(step))
    assert consumed == want
    assert sum(consumed.values()) == TOTAL * BATCH
