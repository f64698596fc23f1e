"""The few collectives the engine needs, degrading to no-ops without a process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def active(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if active(group) else 0


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if active(group) else 1


def decided_by_rank0(fn: Callable[[], T], group: Any = None) -> T:
    """Run fn on rank 0 only and give every rank its result (or its exception)."""
    if not active(group):
        return fn()
    box: list[Any] = [None]
    if rank(group) == 0:
        try:
            box[0] = (True, fn())
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            box[0] = (False, exc)
    dist.broadcast_object_list(box, src=0, group=group)
    ok, value = box[0]
    if not ok:
        raise value
    result: T = value
    return result


def gather_all(obj: T, group: Any = None) -> list[T]:
    if not active(group):
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
