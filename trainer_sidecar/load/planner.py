"""The load planner: DCP's default one, with safe non-tensor values and named mismatches.

Two things DCP's ``DefaultLoadPlanner`` does not do for us:

- ``load_bytes`` there is ``torch.load(..., weights_only=False)``: a non-tensor
  value (the ``extra`` dict: step, RNG states, data positions; the optimizer's
  param groups) is an arbitrary pickle. Here it loads with ``weights_only=True``
  (plain containers, numbers, strings, tensors, and whatever the user added
  with ``torch.serialization.add_safe_globals``); a value it refuses is an
  ``UnsafeCheckpointError`` naming the step and the item, so the checkpoint is
  skipped like a corrupt one. ``trust_pickled_values`` is the explicit opt-out.
- A state that does not match the checkpoint (a missing key, a shape
  mismatch) fails inside ``create_local_plan``; it is raised as ``StateMismatch``
  so the caller can tell it from a store outage or a corrupt chunk that DCP
  wraps in the same ``CheckpointException``.

Errors raised here and in the reader cross ranks: DCP gathers every rank's
failure to every rank (pickled), so each must survive a pickle round trip.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ..errors import CheckpointError, UnsafeCheckpointError

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")  # how weights_only's refusal names the global


class StateMismatch(CheckpointError):
    """The state being loaded does not match the checkpoint (DCP's planner said so)."""


def decode_value(
    data: bytes | memoryview | io.BytesIO, *, step: int, fqn: str, trusted: bool
) -> Any:
    """A non-tensor value as DCP stored it (``torch.save``), by weights_only rules unless
    ``trusted``; a refusal is an UnsafeCheckpointError naming the step and the item."""
    stream = data if isinstance(data, io.BytesIO) else io.BytesIO(data)
    if trusted:
        return torch.load(stream, weights_only=False)
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as exc:
        named = _GLOBAL.search(str(exc))
        raise UnsafeCheckpointError(
            step,
            f"value {fqn!r}",
            "is refused by torch.load(weights_only=True)"
            + (f": it names {named.group(1)}" if named else "")
            + "; if you wrote it yourself and nobody else can write there, set "
            "CTJ_TRUST_PICKLED_VALUES=1 (or add the class with "
            "torch.serialization.add_safe_globals)",
        ) from None
    except Exception as exc:  # noqa: BLE001 - a value that does not deserialize: unusable
        raise UnsafeCheckpointError(
            step, f"value {fqn!r}", f"does not deserialize ({type(exc).__name__}: {exc})"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values load by weights_only rules."""

    def __init__(self, *, step: int, trust_pickled_values: bool = False) -> None:
        super().__init__()
        self.step = step
        self.trust_pickled_values = trust_pickled_values

    def create_local_plan(self) -> LoadPlan:
        try:
            return super().create_local_plan()
        except Exception as exc:  # noqa: BLE001 - the metadata is checked: this is the state
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            raise StateMismatch(
                f"checkpoint step {self.step} does not match the state being loaded ({first}): "
                "load it into the same model and optimizer that saved it"
            ) from exc

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = decode_value(value, step=self.step, fqn=fqn, trusted=self.trust_pickled_values)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
