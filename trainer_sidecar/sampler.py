"""A data sampler whose position is a global sample index: exactly-once data at any world size.

    sampler = GlobalSampler(len(dataset), 192, rank=rank, world_size=world)
    extra = {"step": 0, "sampler": sampler.state_dict()}
    if ckpt.load(model=model, optimizer=opt, extra=extra):
        sampler.load_state_dict(extra["sampler"])      # refuses another seed/batch/dataset
    while ...:
        x = dataset[sampler.local_batch(sampler.step)]  # this rank's share of the step
        train_one_step(x)
        sampler.advance()                               # the step is done: count its samples
        ckpt.save(step, ..., extra={"step": step, "sampler": sampler.state_dict()})

The global sequence is the concatenation of one permutation of the dataset per
epoch, drawn from a ``torch.Generator`` seeded with ``seed + epoch`` (or the
identity without ``shuffle``): it depends on neither the rank nor the world
size. Global step ``s`` consumes samples ``[s * B, (s + 1) * B)`` of that
sequence (``B = global_batch_size``); rank ``r`` of ``W`` takes the contiguous
``B // W`` samples ``[r * B // W, (r + 1) * B // W)`` of each global batch. A
job that restarts at another world size from a checkpoint at step ``s`` thus
sees exactly the samples after ``s * B``: none skipped, none repeated.

With ``drop_last`` (the default) an epoch is ``len // B`` whole global batches
and the remaining ``len % B`` samples of its permutation are never drawn. Without
it an epoch is every sample, and a global batch may span the end of one epoch
and the start of the next. Either way ``epoch = position // samples_per_epoch``.

The contract for ``position``: it is the number of samples of the steps the
trainer has completed, so always a multiple of ``B``. Only ``advance()`` moves
it (call it once a step's optimizer update is done); drawing indices never does,
so a DataLoader that prefetches ahead of training cannot make a checkpoint skip
samples. Iterating yields this rank's indices from the current position on,
step after step, across epochs, without end.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["GlobalSampler"]

_FIELDS = ("position", "seed", "global_batch_size", "dataset_len")


class GlobalSampler(Sampler[int]):
    """This rank's share of a global, world-size-independent sample order (module doc)."""

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        position: int = 0,
    ) -> None:
        super().__init__()
        if dataset_len <= 0:
            raise ValueError(f"dataset_len must be positive, got {dataset_len}")
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
        if global_batch_size % world_size:
            lower = global_batch_size - global_batch_size % world_size
            raise ValueError(
                f"global_batch_size ({global_batch_size}) is not divisible by world_size "
                f"({world_size}): every rank takes an equal share of each global batch. "
                f"Use a global_batch_size that is a multiple of {world_size} "
                f"(e.g. {lower or world_size} or {lower + world_size}), or a world size that "
                f"divides {global_batch_size}; keep it fixed across restarts"
            )
        if drop_last and dataset_len < global_batch_size:
            raise ValueError(
                f"dataset_len ({dataset_len}) is smaller than global_batch_size "
                f"({global_batch_size}): with drop_last an epoch has no whole global batch "
                "(use a smaller global_batch_size or drop_last=False)"
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.local_batch_size = global_batch_size // world_size
        self.samples_per_epoch = (
            dataset_len - dataset_len % global_batch_size if drop_last else dataset_len
        )
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> its permutation (the last two)
        self.position = self._checked_position(position)

    # -- position -----------------------------------------------------------------

    @property
    def step(self) -> int:
        """The next global step to train: the number of completed ones."""
        return self.position // self.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.position // self.samples_per_epoch

    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` more global steps as completed (call it after each optimizer step)."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.position += steps * self.global_batch_size

    def _checked_position(self, position: int) -> int:
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position must be a non-negative int, got {position!r}")
        if position % self.global_batch_size:
            raise ValueError(
                f"position {position} is not a whole number of global batches of "
                f"global_batch_size {self.global_batch_size}: it counts the samples of "
                "completed steps"
            )
        return position

    # -- the order ------------------------------------------------------------------

    def _order(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_len, generator=generator)
            else:
                order = torch.arange(self.dataset_len)
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at global positions ``[start, start + count)``, across epochs."""
        out: list[int] = []
        position, end = start, start + count
        while position < end:
            epoch, offset = divmod(position, self.samples_per_epoch)
            take = min(end - position, self.samples_per_epoch - offset)
            out.extend(self._order(epoch)[offset : offset + take].tolist())
            position += take
        return out

    def global_batch(self, step: int) -> list[int]:
        """Every rank's samples of global step ``step``, in rank order (a pure function)."""
        return self.indices(step * self.global_batch_size, self.global_batch_size)

    def local_batch(self, step: int) -> list[int]:
        """This rank's contiguous share of global step ``step`` (a pure function)."""
        start = step * self.global_batch_size + self.rank * self.local_batch_size
        return self.indices(start, self.local_batch_size)

    def __iter__(self) -> Iterator[int]:
        """This rank's indices from the current position on, step by step, without end.
        Drawing them does not move ``position`` (see ``advance``)."""
        return self._from(self.step)

    def _from(self, step: int) -> Iterator[int]:
        while True:
            yield from self.local_batch(step)
            step += 1

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Plain ints, for the Checkpointer's ``extra`` (loaded by weights_only rules)."""
        return {
            "position": self.position,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position; refuses (ValueError naming the field) a state saved
        with another seed, global batch size or dataset length: its position would not
        name the same samples, so resuming from it would not be exactly-once."""
        for field in _FIELDS:
            if field not in state:
                raise ValueError(f"sampler state has no {field!r} (keys: {sorted(state)})")
        why = {
            "seed": "the global order would differ",
            "global_batch_size": "the step boundaries would differ",
            "dataset_len": "the dataset changed, so the order and epochs would differ",
        }
        for field, reason in why.items():
            saved, mine = state[field], getattr(self, field)
            if saved != mine:
                raise ValueError(
                    f"the checkpoint's sampler {field} is {saved!r} but this sampler's is "
                    f"{mine!r}: resuming it would not be exactly-once ({reason}). "
                    f"Construct the sampler with {field}={saved!r} to resume this job"
                )
        self.position = self._checked_position(state["position"])
