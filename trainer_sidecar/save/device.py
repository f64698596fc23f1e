"""The one copy from a GPU: device-to-host into page-locked slot memory, waited for.

A slot's mapped file is registered with CUDA (``cudaHostRegister``) once per mapping, so
the copies out of GPU memory are DMA transfers at the bus's speed, all issued at once
(``non_blocking=True``, on each source device's current stream, so they follow the
training step's kernels), and waited for before ``stage_items`` returns: ``save`` never
returns before the bytes are in host memory, so the training loop may overwrite the
tensors at once. A registration that fails (a locked-memory limit, a staging directory
on a filesystem the driver will not pin) leaves the slot unpinned, with one warning: the
copies then go through the driver's pageable path, slower but the same bytes.

Nothing here touches ``torch.cuda`` unless a tensor is on a GPU: a CPU run never
initialises CUDA, and needs no driver.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

log = logging.getLogger("ctj.staging")

_warned = False  # one warning per process for a slot that could not be pinned


def cuda_devices(tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    """The GPUs among the tensors' devices (an attribute read: no CUDA call)."""
    return {t.device for t in tensors if t.is_cuda}


def register(ptr: int, size: int) -> bool:
    """Page-lock host memory [ptr, ptr + size) for CUDA copies; False if it failed."""
    global _warned
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
    except Exception as exc:  # noqa: BLE001 - no runtime to pin with: copy unpinned
        reason = f"{type(exc).__name__}: {exc}"
    else:
        if err == 0:
            return True
        _clear_last_error()
        reason = f"cudaHostRegister returned cudaError {err}"
    if not _warned:
        _warned = True
        log.warning(
            "could not pin the staging slot (%s, %s bytes): copies from the GPU go unpinned, "
            "so save() blocks longer; a memory-backed staging directory (an emptyDir with "
            "medium Memory, /dev/shm) can be pinned",
            reason,
            f"{size:,}",
        )
    return False


def unregister(ptr: int) -> None:
    """Undo ``register`` (before the memory is unmapped); a failure is logged, never raised."""
    try:
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception as exc:  # noqa: BLE001 - closing must go on
        log.warning("could not unpin the staging slot: %s", exc)
        return
    if err != 0:
        _clear_last_error()
        log.warning("could not unpin the staging slot: cudaHostUnregister returned %d", err)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the copies issued on each device's current stream (the stream copy_ used)."""
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()


def _clear_last_error() -> None:
    """A failed runtime call stays this thread's last CUDA error, which torch's check after
    its next kernel launch would raise as that kernel's: take it now (the check resets it)."""
    try:
        torch.ones(1, device="cuda").add_(1)
    except RuntimeError:
        pass
