"""ctj's checkpoint engine: DCP checkpoints in S3 with incremental and differential deltas.

Public API: ``Checkpointer``, ``CheckpointConfig``, ``CheckpointError``.
"""

__version__ = "0.1.0"

from .checkpointer import Checkpointer, LoadResult, SaveResult  # noqa: E402
from .config import CheckpointConfig  # noqa: E402
from .errors import CheckpointError, CorruptCheckpointError, NoCheckpointError  # noqa: E402

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "LoadResult",
    "NoCheckpointError",
    "SaveResult",
    "__version__",
]
