"""Seeding a job from another job's checkpoints (spec.checkpoint.resumeFrom), read-only.

A job's checkpoints live at ``<uri>/<namespace>/<name>-<uid>``: a job re-created (to change
a field, to retry after maxRestarts, to move it) gets a new uid, so a new, empty location.
``resume_from`` names where to seed it from: a location, or a job's name. A name maps to
every location that name ever had, ``<name>-<uid>``: the source job may be deleted and its
uid known to nobody (the operator holds no S3 credentials, so only the trainer can look).
The newest commit among them, by commit time as retention reads it, is the source:
re-created runs of one name follow each other, so the newest commit is where the last one
got to (a later run that started over from step 0 included). None is a one-line error
naming the field; never a silent start from step 0.

The source is only read: it is opened through ``ReadOnlyStore`` (a put or a delete is a
bug and raises), no save ever takes it as a reference (a save plans from its own location
alone), and nothing here writes a hold, a gc marker or a retirement there.

Decisions are pure (``job_locations``, ``choose``); ``resolve`` is the adapter that lists.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Iterable, Iterator, Sequence

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..store import repository
from ..store.base import Location, ObjectInfo, ObjectStore, read_into
from ..store.local import LocalStore
from ..store.s3 import S3Settings, S3Store, open_store

FIELD = "spec.checkpoint.resumeFrom (CTJ_RESUME_FROM)"
"""How errors name the setting: the job's field, and the variable a local run sets."""

UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
"""A Kubernetes uid (RFC 4122, lowercase): what follows ``<name>-`` in a job's location.
Matching it whole keeps job ``train`` from taking ``train-2-<uid>`` (job ``train-2``)."""


class ResumeSourceError(CheckpointError):
    """resumeFrom names no committed checkpoint (or cannot be read): says which and the fix."""


class ReadOnlyStore:
    """A store a job reads another job's checkpoints through: a write is refused, loudly."""

    def __init__(self, inner: ObjectStore, where: str) -> None:
        self.inner = inner
        self.where = where

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        raise CheckpointError(f"{self.where} is a resume source: read-only (put of {key})")

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        return self.inner.get(key, byte_range=byte_range)

    def get_into(self, key: str, into: Sequence[memoryview], *, byte_range: tuple[int, int]) -> int:
        return read_into(self.inner, key, into, byte_range=byte_range)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        raise CheckpointError(f"{self.where} is a resume source: read-only (delete)")


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """A location that may seed the job, and its newest readable commit (None: none)."""

    uri: str
    step: int | None = None
    committed_at: float | None = None  # the manifest's ``created``


@dataclasses.dataclass(frozen=True, slots=True)
class Seed:
    """The location chosen, its newest commit when chosen, and the others looked at."""

    uri: str
    step: int
    others: tuple[Candidate, ...] = ()


def same_location(a: str, b: str) -> bool:
    return str(Location.parse(a)) == str(Location.parse(b))


def job_locations(children: Iterable[str], job: str) -> list[str]:
    """The names of ``job``'s locations among a directory's entries: ``<job>-<uid>``."""
    head = f"{job}-"
    return sorted(c for c in children if c.startswith(head) and UID.fullmatch(c[len(head) :]))


def choose(candidates: Sequence[Candidate], *, wanted: str) -> Seed:
    """The candidate with the newest commit (by commit time, then step), or an error saying
    what was looked at. ``wanted``: what resumeFrom asked for, in words."""
    found = [c for c in candidates if c.step is not None and c.committed_at is not None]
    if not found:
        looked = (
            f"{len(candidates)} location(s) without a committed checkpoint: "
            + ", ".join(c.uri for c in candidates)
            if candidates
            else "no location"
        )
        raise ResumeSourceError(
            f"{FIELD}: {wanted} has no committed checkpoint (found {looked}): the job cannot "
            "be seeded from it. Check the source with `ctj checkpoints ls <location>`, set "
            "resumeFrom to a location that has one (the old job's status.storage.uri), or "
            "remove resumeFrom to start from step 0"
        )
    best = max(found, key=lambda c: (c.committed_at, c.step))
    assert best.step is not None
    return Seed(best.uri, best.step, tuple(c for c in candidates if c is not best))


# -- adapters: listing and opening the source, read-only ---------------------------------------


def _settings(config: CheckpointConfig) -> S3Settings:
    return S3Settings.from_env(endpoint_url=config.endpoint_url, region=config.region)


def open_source(uri: str, config: CheckpointConfig) -> ReadOnlyStore:
    """The source location, read-only; a ``file://`` one is never created."""
    try:
        store = open_store(uri, _settings(config), create=False)
    except CheckpointError as exc:
        raise ResumeSourceError(f"{FIELD}: {exc}") from None
    return ReadOnlyStore(store, uri)


def _children(parent: str, prefix: str, config: CheckpointConfig) -> list[str]:
    """The entries of directory ``parent`` whose names start with ``prefix`` (one level: an
    S3 listing by delimiter, one request per 1000 locations, never the chunks under them)."""
    try:
        store = open_store(parent, _settings(config), create=False)
    except CheckpointError:  # a file:// directory that does not exist holds no location
        return []
    if isinstance(store, LocalStore):
        with os.scandir(store.root) as entries:
            return [e.name for e in entries if e.is_dir() and e.name.startswith(prefix)]
    return list(_s3_children(store, prefix))


def _s3_children(store: S3Store, prefix: str) -> Iterator[str]:
    # The ObjectStore protocol lists recursively (every chunk); this one listing needs S3's
    # delimiter, which S3Store does not offer: its client, with its retries.
    args = {"Bucket": store.bucket, "Prefix": store.prefix + prefix, "Delimiter": "/"}
    cut = len(store.prefix)
    while True:
        page = store._retrying("LIST", prefix, functools.partial(store._s3.list_objects_v2, **args))
        for common in page.get("CommonPrefixes", []):
            yield common["Prefix"][cut:].rstrip("/")
        if not page.get("IsTruncated"):
            return
        args["ContinuationToken"] = page["NextContinuationToken"]


def candidate(uri: str, config: CheckpointConfig) -> Candidate:
    """``uri`` and its newest readable commit."""
    manifest = repository.latest_manifest(open_source(uri, config))
    if manifest is None:
        return Candidate(uri)
    return Candidate(uri, manifest.step, manifest.created)


def resolve(config: CheckpointConfig) -> Seed:
    """Where this run seeds from (rank 0 calls it; ``collectives.decided_by_rank0``)."""
    if config.resume_from is None:
        raise ValueError("no resume_from configured")
    if config.resume_from_job is None:
        if same_location(config.resume_from, config.uri):
            raise ResumeSourceError(
                f"{FIELD}: {config.resume_from} is this job's own location: name the old "
                "job's location (its status.storage.uri) or its name"
            )
        return choose([candidate(config.resume_from, config)], wanted=config.resume_from)
    parent = config.resume_from.rstrip("/")
    job = config.resume_from_job
    names = job_locations(_children(parent, f"{job}-", config), job)
    uris = [f"{parent}/{n}" for n in names]
    others = [u for u in uris if not same_location(u, config.uri)]  # a re-created job's own
    return choose(
        [candidate(u, config) for u in others],
        wanted=f"job {job!r} (its locations {parent}/{job}-<uid>)",
    )
