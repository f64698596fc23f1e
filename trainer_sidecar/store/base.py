"""The object-store interface the engine is written against, and URI parsing.

Four methods, keyword-only options, nothing else: the engine never needs more
than put / get (optionally a byte range) / list / delete, and keeping it that
small is what lets a local directory and every S3-compatible server behave the
same. Keys are '/'-separated and relative to the store's root.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
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


@runtime_checkable
class ReadsInto(Protocol):
    """A store that can write a GET's bytes straight into a caller's buffers (S3Store)."""

    def get_into(
        self, key: str, into: Sequence[memoryview], *, byte_range: tuple[int, int]
    ) -> int: ...


def read_into(
    store: ObjectStore, key: str, into: Sequence[memoryview], *, byte_range: tuple[int, int]
) -> int:
    """The bytes of ``key`` in ``byte_range`` written into the buffers ``into``, filling
    each before the next; how many bytes the object has there. When that is more than the
    buffers hold, nothing is written (the caller refuses the object). A store that
    ``ReadsInto`` puts the bytes in place as they arrive, without a buffer of its own or a
    copy (a load's chunks go so into the tensors); any other is read with ``get`` and
    copied. ``ObjectNotFound`` as ``get``."""
    if isinstance(store, ReadsInto):
        return store.get_into(key, into, byte_range=byte_range)
    data = memoryview(store.get(key, byte_range=byte_range))
    if len(data) <= sum(v.nbytes for v in into):
        pos = 0
        for view in into:
            n = min(view.nbytes, len(data) - pos)
            view[:n] = data[pos : pos + n]
            pos += n
    return len(data)


def bounded_reader(store: ObjectStore, max_bytes: int) -> Callable[[str], bytes]:
    """``read_bounded`` of ``store`` as a one-argument fetch (a manifest's rank manifests)."""
    return functools.partial(read_bounded, store, max_bytes=max_bytes)


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
"""What starts a URI: a string that starts so without '://' is a mistyped URI, not a path."""
_BUCKET = re.compile(r"[A-Za-z0-9._-]+")
"""The characters any S3-compatible server's bucket names are drawn from (AWS's rules are
stricter; the server judges the rest)."""
_USE = "use s3://bucket/prefix (S3, MinIO, ...) or file:///absolute/dir"


def uri_problem(uri: str) -> str | None:
    """Why ``uri`` is no checkpoint location, as a few words that never repeat the URI
    (it may hold a secret someone pasted into it); None when it is one. Strict: a string
    that looks like a URI but is not one is a mistake, never a relative path to create."""
    if not uri:
        return "is empty"
    if uri != uri.strip():
        return "has leading or trailing spaces: remove them"
    if "://" not in uri:
        if _SCHEME.match(uri):
            return "has a scheme without '://' (e.g. s3:/bucket)"
        return None  # a plain path
    try:
        parsed = urlparse(uri)
    except ValueError:  # e.g. an unclosed '['
        return "does not parse as a URI"
    if parsed.scheme not in ("s3", "file"):
        return f"has an unsupported URI scheme {parsed.scheme!r}"
    if "?" in uri or "#" in uri:
        return "has a query or fragment ('?', '#'), which a checkpoint URI never takes"
    if "@" in parsed.netloc:
        return (
            "has credentials in it (user:password@): never put them in a URI; "
            "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            return "has a host: use file:///absolute/path"
        return None
    if not parsed.netloc:
        return "names no bucket"
    if not _BUCKET.fullmatch(parsed.netloc):
        return f"has a bucket name with characters no bucket has ({parsed.netloc!r})"
    segments = parsed.path.strip("/").split("/")
    if parsed.path.strip("/") and any(s in ("", ".", "..") for s in segments):
        return "has an empty, '.' or '..' segment in its prefix"
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Location:
    """A parsed checkpoint URI: ``s3://bucket/prefix`` or ``file:///dir`` (or a plain path)."""

    scheme: str
    bucket: str
    prefix: str  # no leading or trailing '/'

    @classmethod
    def parse(cls, uri: str) -> Location:
        problem = uri_problem(uri)
        if problem is not None:
            shown = "" if "@" in uri else f" {uri!r}"  # never echo a pasted secret
            fix = "" if ": " in problem else f": {_USE}"
            raise CheckpointError(f"checkpoint URI{shown} {problem}{fix}")
        if "://" not in uri:
            return cls("file", "", uri.rstrip("/") or "/")
        parsed = urlparse(uri)
        if parsed.scheme == "s3":
            return cls("s3", parsed.netloc, parsed.path.strip("/"))
        return cls("file", "", parsed.path.rstrip("/") or "/")

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"file://{self.prefix}"
