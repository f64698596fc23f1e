"""The few collectives the engine runs itself, degrading to no-ops without a process group.

Their tensors go on the process group's device (``device``): an NCCL group takes CUDA
tensors only, so the preemption flag (``any_rank``) and the object collectives travel
through the current CUDA device there, and through host memory on gloo. As in every NCCL
program, each rank must call ``torch.cuda.set_device(local_rank)`` before the first
collective: ``all_gather_object`` has no ``device`` argument and always uses the current
CUDA device, so without it every rank of a node would use GPU 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import CheckpointError

T = TypeVar("T")

# the CPU-capable backends; any other (nccl, xccl, ...) takes its accelerator's tensors
_CPU_BACKENDS = frozenset({"gloo", "mpi", "ucc"})


def active(group: Any = None) -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if active(group) else 0


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if active(group) else 1


def device_type(backend: str) -> str:
    """The device type a backend's collectives take: "cpu" when any of its backends runs on
    the CPU (``gloo``; ``cpu:gloo,cuda:nccl``), else the accelerator's (``nccl`` -> cuda)."""
    pairs = [p.strip().lower() for p in backend.split(",") if p.strip()]
    devices = []
    for pair in pairs:
        dev, sep, name = pair.rpartition(":")
        if sep:  # "device:backend", as init_process_group takes it
            devices.append(dev)
        elif name in _CPU_BACKENDS:
            devices.append("cpu")
        else:
            devices.append(_accelerator_of(name))
    if not devices or "cpu" in devices:
        return "cpu"
    return devices[0]


def _accelerator_of(backend: str) -> str:
    # registered backends declare their devices; an unknown one keeps the host (as before)
    capability = getattr(dist.Backend, "backend_capability", {}).get(backend) or ["cpu"]
    return "cpu" if "cpu" in capability else str(capability[0])


def device(group: Any = None) -> torch.device:
    """Where this group's collectives take their tensors: cpu without a process group or on
    a CPU-capable backend (gloo), else the current device (``cuda:<current>`` on NCCL).

    Raises CheckpointError when the group was bound to another GPU than the current one
    (``init_process_group(device_id=...)`` without ``torch.cuda.set_device``): the object
    collectives would run on the wrong GPU and hang or fail.
    """
    if not active(group):
        return torch.device("cpu")
    kind = device_type(str(dist.get_backend(group)))
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        return torch.device(kind)
    current = torch.device("cuda", torch.cuda.current_device())
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    if bound is not None and bound.type == "cuda" and bound.index not in (None, current.index):
        raise CheckpointError(
            f"the process group is bound to {bound} but the current CUDA device is {current}: "
            f"call torch.cuda.set_device({bound}) before the first save or load"
        )
    return current


def any_rank(flag: bool, group: Any = None) -> bool:
    """Collective: True on every rank when ``flag`` is True on any (an all-reduce MAX)."""
    if not active(group):
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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
    dist.broadcast_object_list(box, src=0, group=group, device=device(group))
    ok, value = box[0]
    if not ok:
        raise value
    result: T = value
    return result


def gather_all(obj: T, group: Any = None) -> list[T]:
    """Every rank's ``obj``, in rank order. On NCCL it travels through the current CUDA
    device (all_gather_object takes no device): ``device`` checks that it is the right one."""
    if not active(group):
        return [obj]
    device(group)  # raises if the current CUDA device is not the group's
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
