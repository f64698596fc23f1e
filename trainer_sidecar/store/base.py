"""The object-store interface the engine is written against, and URI parsing.

Four methods, keyword-only options, nothing else: the engine never needs more
than put / get (optionally a byte range) / list / delete, and keeping it that
small is what lets a local directory and every S3-compatible server behave the
same. Keys are '/'-separated and relative to the store's root.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
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
    end exclusive.
    """

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None: ...

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes: ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]: ...

    def delete(self, keys: Iterable[str]) -> None: ...


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
