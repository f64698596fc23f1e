"""The object-store interface the engine is written against, and URI parsing.

Four methods, keyword-only options, nothing else: the engine never needs more
than put / get (optionally a byte range) / list / delete, and keeping it that
small is what lets a local directory and every S3-compatible server behave the
same. Keys are '/'-separated and relative to the store's root.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, runtime_checkable
from urllib.parse import urlparse

from ..errors import CheckpointError


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: float  # seconds since the epoch, on the store's clock


@runtime_checkable
class ObjectStore(Protocol):
    """What a checkpoint location must offer.

    ``put(if_absent=True)`` is a create-only write: it raises ``ObjectExists``
    instead of replacing an object; the commit relies on it.
    ``get`` raises ``ObjectNotFound``; ``byte_range`` is ``(start, end)``,
    end exclusive, and gives the bytes of the object in it: fewer (down to none)
    where the object ends before ``end`` (``read_bounded`` relies on that).
    """

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None: ...

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes: ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]: ...

    def delete(self, keys: Iterable[str]) -> None: ...


def read_bounded(store: ObjectStore, key: str, max_bytes: int) -> bytes:
    """The object at ``key``, or its first ``max_bytes + 1`` bytes when it is larger: a
    caller that gets more than ``max_bytes`` knows the object is too large, having read
    (and allocated) no more than that, whatever the object's size. One ranged GET
    (``bytes=0-max_bytes``), which every store answers with what it has; so any store,
    and any wrapper passing ``byte_range`` on, bounds it. ``ObjectNotFound`` as ``get``.

    Every read of an object whose size the reader does not already know (a manifest, a
    rank manifest, a part, a whole chunk) goes through here with the most that kind of
    object may be (format.manifest's MAX_*_BYTES, a chunk's size)."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes {max_bytes} is negative")
    return store.get(key, byte_range=(0, max_bytes + 1))


def bounded_reader(store: ObjectStore, max_bytes: int) -> Callable[[str], bytes]:
    """``read_bounded`` of ``store`` as a one-argument fetch (a manifest's rank manifests)."""
    return functools.partial(read_bounded, store, max_bytes=max_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class Location:
    """A parsed checkpoint URI: ``s3://bucket/prefix`` or ``file:///dir`` (or a plain path)."""

    scheme: str
    bucket: str
    prefix: str  # no leading or trailing '/'

    @classmethod
    def parse(cls, uri: str) -> Location:
        if not uri:
            raise CheckpointError("checkpoint URI is empty: use s3://bucket/prefix or file:///dir")
        if "://" not in uri:
            return cls("file", "", uri.rstrip("/") or "/")
        parsed = urlparse(uri)
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise CheckpointError(f"URI {uri!r} names no bucket: use s3://bucket/prefix")
            return cls("s3", parsed.netloc, parsed.path.strip("/"))
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise CheckpointError(f"URI {uri!r} has a host: use file:///absolute/path")
            return cls("file", "", parsed.path.rstrip("/") or "/")
        raise CheckpointError(
            f"unsupported URI scheme {parsed.scheme!r} in {uri!r}: "
            "use s3://bucket/prefix (S3, MinIO, ...) or file:///dir"
        )

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"file://{self.prefix}"
