"""GlobalSampler: a global position makes data exactly-once across world-size changes."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch

from trainer_sidecar import GlobalSampler

LEN, BATCH = 100, 12  # 8 whole global batches per epoch, 4 samples dropped


def ranks(world: int, *, shuffle: bool = True) -> list[GlobalSampler]:
    return [
        GlobalSampler(LEN, BATCH, rank=r, world_size=world, seed=7, shuffle=shuffle)
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_step_splits_the_global_batch_into_disjoint_contiguous_shares(world: int) -> None:
    samplers = ranks(world)
    for step in range(20):  # across epoch boundaries
        want = samplers[0].global_batch(step)
        shares = [s.local_batch(step) for s in samplers]
        assert all(len(share) == BATCH // world for share in shares)
        assert [i for share in shares for i in share] == want  # rank order, contiguous
        assert len(set(want)) == BATCH  # disjoint


def test_the_global_order_depends_on_seed_and_epoch_only() -> None:
    one = ranks(1)[0]
    for world in (2, 3, 4):
        assert ranks(world)[-1].global_batch(13) == one.global_batch(13)
    epoch0 = torch.randperm(LEN, generator=torch.Generator().manual_seed(7)).tolist()
    epoch1 = torch.randperm(LEN, generator=torch.Generator().manual_seed(8)).tolist()
    assert one.indices(0, 96) == epoch0[:96]
    assert one.global_batch(8) == epoch1[:BATCH]  # step 8 is the first of epoch 1
    other = GlobalSampler(LEN, BATCH, rank=0, world_size=1, seed=8)
    assert other.global_batch(0) != one.global_batch(0)


def train(sampler: GlobalSampler, steps: int, seen: Counter[int]) -> None:
    """What a trainer does: draw this rank's indices for a step, train, advance."""
    draw = iter(sampler)
    for _ in range(steps):
        seen.update(next(draw) for _ in range(sampler.local_batch_size))
        sampler.advance()


def roundtrip(state: dict[str, int]) -> dict[str, int]:
    """The way extra values come back from a checkpoint: torch.save, weights_only load."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded: dict[str, int] = torch.load(buf, weights_only=True)
    return loaded


@pytest.mark.parametrize("new_world", [3, 2, 1])
def test_resume_at_another_world_size_sees_exactly_the_remaining_sequence(
    new_world: int,
) -> None:
    first, total = 11, 30  # 30 steps: 3 epochs and a part; the save falls in epoch 1
    seen: Counter[int] = Counter()
    before = ranks(4)
    for s in before:
        train(s, first, seen)
    state = roundtrip(before[0].state_dict())
    assert state == {
        "position": first * BATCH,
        "seed": 7,
        "global_batch_size": BATCH,
        "dataset_len": LEN,
    }
    assert all(s.state_dict() == state for s in before)
    after = ranks(new_world)
    for s in after:
        s.load_state_dict(state)
        assert s.step == first and s.epoch == 1
        train(s, total - first, seen)
    reference = ranks(1)[0]
    want = Counter(i for step in range(total) for i in reference.global_batch(step))
    assert seen == want  # every sample of the 30 global steps, each as often as in one run
    per_epoch = Counter(i for step in range(8) for i in reference.global_batch(step))
    assert len(per_epoch) == 96 and set(per_epoch.values()) == {1}  # once per epoch


def test_epochs_roll_over_and_drop_last_skips_each_epochs_tail() -> None:
    s = GlobalSampler(LEN, BATCH, rank=0, world_size=1, seed=3)
    assert s.samples_per_epoch == 96
    s.advance(7)
    assert (s.step, s.epoch, s.position) == (7, 0, 84)
    s.advance()
    assert (s.step, s.epoch, s.position) == (8, 1, 96)
    order1 = torch.randperm(LEN, generator=torch.Generator().manual_seed(4)).tolist()
    assert s.local_batch(s.step) == order1[:BATCH]
    drawn = iter(s)
    assert [next(drawn) for _ in range(2 * BATCH)] == order1[: 2 * BATCH]
    assert s.position == 96, "drawing indices does not move the position"


def test_without_drop_last_a_batch_spans_the_epoch_boundary() -> None:
    s = GlobalSampler(LEN, BATCH, rank=0, world_size=1, seed=3, drop_last=False)
    assert s.samples_per_epoch == LEN
    order0 = torch.randperm(LEN, generator=torch.Generator().manual_seed(3)).tolist()
    order1 = torch.randperm(LEN, generator=torch.Generator().manual_seed(4)).tolist()
    assert s.global_batch(8) == order0[96:] + order1[:8]
    s.advance(9)
    assert s.epoch == 1
    everything = [i for step in range(25) for i in s.global_batch(step)]  # 300 = 3 epochs
    assert Counter(everything) == Counter({i: 3 for i in range(LEN)})


def test_shuffle_false_is_the_dataset_order() -> None:
    shares = ranks(2, shuffle=False)
    assert shares[0].global_batch(0) == list(range(12))
    assert shares[1].local_batch(1) == list(range(18, 24))
    assert shares[0].global_batch(8) == list(range(12))  # epoch 1 starts over at 0
    assert shares[0].global_batch(7) == list(range(84, 96))


def test_position_is_given_at_construction() -> None:
    s = GlobalSampler(LEN, BATCH, rank=1, world_size=2, position=5 * BATCH)
    assert s.step == 5 and next(iter(s)) == s.global_batch(5)[6]
    with pytest.raises(ValueError, match="whole number of global batches"):
        GlobalSampler(LEN, BATCH, rank=0, world_size=1, position=5)


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("seed", 8, "seed=8"),
        ("global_batch_size", 24, "global_batch_size=24"),
        ("dataset_len", 101, "dataset_len=101"),
    ],
)
def test_a_state_saved_with_another_order_is_refused(field: str, value: int, fix: str) -> None:
    s = ranks(3)[1]
    state = dict(ranks(4)[0].state_dict(), position=2 * BATCH)
    state[field] = value
    with pytest.raises(ValueError, match="not be exactly-once") as err:
        s.load_state_dict(state)
    assert f"sampler {field} is {value}" in str(err.value) and fix in str(err.value)
    assert s.position == 0, "a refused state leaves the sampler as it was"


def test_a_state_missing_a_field_or_off_a_step_boundary_is_refused() -> None:
    s = ranks(2)[0]
    with pytest.raises(ValueError, match="'dataset_len'"):
        s.load_state_dict({"position": 0, "seed": 7, "global_batch_size": BATCH})
    with pytest.raises(ValueError, match="whole number of global batches"):
        s.load_state_dict(dict(s.state_dict(), position=13))


def test_an_indivisible_global_batch_names_both_sizes_and_the_fix() -> None:
    with pytest.raises(ValueError) as err:
        GlobalSampler(LEN, 10, rank=0, world_size=4)
    text = str(err.value)
    assert "global_batch_size (10)" in text and "world_size (4)" in text
    assert "multiple of 4" in text and "e.g. 8 or 12" in text


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="rank"):
        GlobalSampler(LEN, BATCH, rank=2, world_size=2)
    with pytest.raises(ValueError, match="smaller than global_batch_size"):
        GlobalSampler(10, BATCH, rank=0, world_size=1)
    with pytest.raises(ValueError, match="steps"):
        GlobalSampler(LEN, BATCH, rank=0, world_size=1).advance(-1)
    assert GlobalSampler(10, BATCH, rank=0, world_size=1, drop_last=False).global_batch(0)
