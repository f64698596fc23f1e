"""ctj's checkpoint engine: DCP checkpoints in S3 with incremental and differential deltas.

Public API: ``Checkpointer``, ``CheckpointConfig``, ``CheckpointError`` (and the
result types). The names load lazily, so tools that only read the store (the
operator, ``ctj checkpoints ls``) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Checkpointer": "checkpointer",
    "LoadResult": "checkpointer",
    "PendingSave": "checkpointer",
    "SaveResult": "checkpointer",
    "CheckpointConfig": "config",
    "CheckpointError": "errors",
    "CommitConflict": "errors",
    "CorruptCheckpointError": "errors",
    "NoCheckpointError": "errors",
    "SaveFailed": "errors",
    "StoreUnavailable": "errors",
    "GlobalSampler": "sampler",
}

if TYPE_CHECKING:
    from .checkpointer import Checkpointer, LoadResult, PendingSave, SaveResult
    from .config import CheckpointConfig
    from .errors import (
        CheckpointError,
        CommitConflict,
        CorruptCheckpointError,
        NoCheckpointError,
        SaveFailed,
        StoreUnavailable,
    )
    from .sampler import GlobalSampler


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "CommitConflict",
    "CorruptCheckpointError",
    "GlobalSampler",
    "LoadResult",
    "NoCheckpointError",
    "PendingSave",
    "SaveFailed",
    "SaveResult",
    "StoreUnavailable",
    "__version__",
]
