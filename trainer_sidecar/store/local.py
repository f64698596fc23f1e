"""A local directory as an object store (``file://`` URIs): runs without S3.

Writes go to a temporary name and are published atomically: ``os.replace`` for
plain puts, ``os.link`` for create-only puts (link fails if the name exists, so
two committers can never both win). A reader therefore never sees half an object.

Durable when a call returns (a commit reported on ``file://`` survives a power cut): the
file's data is synced before its name is published, then the directory holding the name,
and the parent of every directory a call created (``_sync_dir``); a delete syncs the
directories it changed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import CheckpointError, ObjectExists, ObjectNotFound
from .base import ObjectInfo

_TMP_PREFIX = ".tmp-"


class LocalStore:
    """``create=False``: the directory must exist (the CLI's commands never create it)."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(root)
        if create:
            try:
                _make_dirs(self.root)
            except OSError as exc:
                raise CheckpointError(
                    f"cannot create checkpoint directory {self.root}: {exc.strerror}; "
                    "choose a writable path"
                ) from None
        elif not self.root.is_dir():  # never created here: a reader must not make what it reads
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise CheckpointError(
                f"checkpoint directory {self.root} {what}: check the URI "
                "(a job creates its directory at its first save)"
            )

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad object key {key!r}")
        return self.root / key

    def check_conditional_writes(self) -> None:
        """Nothing to probe: link(2) atomically refuses a name that exists (S3Store's
        method of the same name probes its server)."""

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        path = self._path(key)
        _make_dirs(path.parent)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise ObjectExists(key) from None
            else:
                os.replace(tmp, path)
                tmp = None  # type: ignore[assignment]
            _sync_dir(path.parent)  # the new name: durable before the put returns
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                if byte_range is None:
                    return f.read()
                start, end = byte_range
                f.seek(start)
                return f.read(end - start)
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        head, _, _ = prefix.rpartition("/")
        base = self.root / head if head else self.root
        if not base.is_dir():
            return
        found: list[ObjectInfo] = []
        for dirpath, _dirnames, filenames in os.walk(base):
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    st = full.stat()
                except FileNotFoundError:
                    continue
                found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        yield from sorted(found, key=lambda o: o.key)  # S3's order: by key

    def delete(self, keys: Iterable[str]) -> None:
        changed: dict[Path, None] = {}  # the directories whose entries went, in order
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            changed[path.parent] = None
        for directory in changed:  # a retired manifest must not come back after a crash
            _sync_dir(directory)


def _sync_dir(path: Path) -> None:
    """fsync a directory: its entries (a new, renamed or removed name) reach the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: Path) -> None:
    """``mkdir -p``, each directory it creates made durable: its parent's entry synced."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:  # made meanwhile by another writer (synced here all the same)
            if not directory.is_dir():
                raise
        _sync_dir(directory.parent)
