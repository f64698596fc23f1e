"""Errors a user can act on, and the store's own small vocabulary.

`CheckpointError` carries a one-line message that names the problem and the fix;
the CLI prints it without a traceback. Everything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A problem the user can fix (bad URI, missing bucket, wrong credentials...)."""


class NoCheckpointError(CheckpointError):
    """The location holds no committed checkpoint (or none at the requested step)."""


class CorruptCheckpointError(CheckpointError):
    """A chunk of a committed checkpoint is missing or fails its hash check."""

    def __init__(self, step: int, chunk_id: str, reason: str) -> None:
        super().__init__(f"checkpoint step {step} is unusable: chunk {chunk_id} {reason}")
        self.step = step
        self.chunk_id = chunk_id
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        # collectives carry it between ranks: rebuild from the three fields, not the message
        return type(self), (self.step, self.chunk_id, self.reason)


class CorruptManifestError(CorruptCheckpointError):
    """A rank manifest a committed checkpoint names is missing, fails its hash check, does
    not parse, or is not that rank's of that save: the checkpoint is unusable."""

    def __init__(self, step: int, what: str, reason: str) -> None:
        CheckpointError.__init__(self, f"checkpoint step {step} is unusable: {what} {reason}")
        self.step = step
        self.chunk_id = what
        self.reason = reason


class UploadAborted(Exception):
    """An upload stopped before it finished (shutdown grace ran out); nothing was committed."""


class ObjectNotFound(Exception):
    """The object store has no object at a key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class ObjectExists(Exception):
    """A conditional (create-only) write found the key already taken."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint holds something that would run code when loaded (a pickle outside the
    allow-list, a file name escaping its directory): treated like a corrupt one."""

    def __init__(self, step: int, what: str, reason: str) -> None:
        CheckpointError.__init__(
            self, f"checkpoint step {step} is unusable: {what} {reason} (refused, never run)"
        )
        self.step = step
        self.chunk_id = what
        self.reason = reason


class StoreUnavailable(CheckpointError):
    """The object store kept failing (timeouts, resets, 5xx) after every retry."""


class SaveFailed(CheckpointError):
    """A save did not commit: a rank's upload or the commit failed (the reason says which)."""


class CommitConflict(SaveFailed):
    """Another save (another attempt, or a second writer) committed this step first."""
