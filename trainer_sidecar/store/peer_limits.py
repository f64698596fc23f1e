"""The peer tier's limits: how long and how much each side of the peer protocol allows.

A peer is another pod of the job, but nothing it does may hold up a restore, or the
sidecar that serves a node's cache (the process that commits the job's checkpoints).
So every wait on a peer connection has a wall-clock deadline (not a per-receive
timeout, which a byte every few seconds never trips), every size is bounded before
anything is read, and a restore stops asking peers once they have cost it a budget:

**The server** (each sidecar) gives a connection ``header_deadline_s`` from the moment
it is ready for a request (accepted, or the previous answer sent) to the end of the
request's headers: an idle keep-alive connection and a trickled request are both
closed then. A body (``POST /v1/has``) must arrive within ``body_deadline_s`` of its
headers, and an answer be taken by the client within ``send_deadline_s``. At most
``max_connections`` are open (one thread each); one more is answered 503 and closed on
the accepting thread, at once.

**The client** (a restoring rank; a replicating sidecar) gives a request for ``n``
bytes ``deadline_s(n)`` = ``request_deadline_s + n / min_rate_bytes_s`` of wall clock
for all of it (name lookup, connect, request, status, headers, body), and a has-query
``locate_deadline_s``. An answer longer than asked (by its Content-Length, or without
one) is a miss before its body is read. A miss is a miss: the next tier (S3) reads the
bytes, and a peer that missed for anything but "not held" is not asked again during
that restore.

**The restore's bound.** The time peers waste is metered as wall clock (the union of
the spans of every miss, of every has-query, and of the part of each hit past
``hit_allowance_s + n / fast_rate_bytes_s``, what the same bytes would take from a fast
store). Once it passes ``restore_budget_s``, no peer is asked again by that client (one
per rank and restore). A rank's reads through the peers therefore take at most
``bound_s(largest range)`` = ``restore_budget_s`` + the longest request that may already
be under way (``max(locate_deadline_s, deadline_s(largest range))``) longer than reads
of the store alone, as long as the store itself serves a request no faster than the hit
allowance (S3: tens of ms to the first byte, tens of MB/s a connection; the allowance is
that lenient because a hit's time includes the rank's own CPU, and a busy node must not
read as a slow peer). With the defaults and 8 MiB chunks: 3 + 3 = 6 s. The ranks of a
restore wait for each other between its phases, so a whole restore's bound is a multiple
of this (load/tiers.py: ``restore_bound_s``).

Every limit can be set from the environment as ``CTJ_PEER_<FIELD>`` (e.g.
``CTJ_PEER_RESTORE_BUDGET_S=2``, ``CTJ_PEER_MAX_CONNECTIONS=32``).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from ..errors import CheckpointError

MIB = 1 << 20
ENV_PREFIX = "CTJ_PEER_"

# -- the server's (store/peers.py: serve_cache) -------------------------------------------
HEADER_DEADLINE_S = 10.0
"""A connection's request line and headers, from when it is ready for one."""
BODY_DEADLINE_S = 10.0
"""A request's body (a has-query: at most ~7 MB), from the end of its headers."""
SEND_DEADLINE_S = 60.0
"""An answer (at most a chunk, 64 MiB: ~1.1 MB/s), taken by the client."""
MAX_CONNECTIONS = 64
"""Connections open at once (a thread each); past it, one is answered 503 and closed."""
MAX_HAS_IDS = 100_000
MAX_BODY_BYTES = MAX_HAS_IDS * 70
"""A has-query's body: 100,000 ids of 64 hex digits, quoted, comma-separated."""

# -- the client's (store/peers.py: PeerCaches) --------------------------------------------
REQUEST_DEADLINE_S = 2.0
"""A request's wall clock beyond its bytes' share: lookup, connect, status and headers."""
MIN_RATE_BYTES_S = 16.0 * MIB
"""A range of n bytes gets n / this more: a peer slower than this is a miss."""
LOCATE_DEADLINE_S = 3.0
"""A has-query (up to 100,000 ids one way, those held back), wall clock."""
KEEPALIVE_S = 1.0
"""A kept-alive connection idle longer is not reused (the server's header deadline
would close it under the request)."""
RESTORE_BUDGET_S = 3.0
"""The wall-clock time peers may waste a restore before it stops asking them."""
HIT_ALLOWANCE_S = 0.1
FAST_RATE_BYTES_S = 128.0 * MIB
"""A hit taking longer than HIT_ALLOWANCE_S + n / FAST_RATE_BYTES_S wastes the rest."""


def _positive(limits: object) -> None:
    for field in dataclasses.fields(limits):  # type: ignore[arg-type]
        value = getattr(limits, field.name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise CheckpointError(
                f"peer cache limit {field.name} is {value!r}: use a number > 0 "
                f"({ENV_PREFIX}{field.name.upper()})"
            )


L = TypeVar("L")


def _from_env(cls: type[L], env: Mapping[str, str] | None, overrides: dict[str, Any]) -> L:
    """``cls`` with each field from ``CTJ_PEER_<FIELD>`` where set, then ``overrides``."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = f"{ENV_PREFIX}{field.name.upper()}"
        if env.get(name):
            kind = int if field.type in ("int", int) else float
            try:
                values[field.name] = kind(env[name])
            except ValueError:
                raise CheckpointError(
                    f"{name} is {env[name]!r}: use a{'n integer' if kind is int else ' number'}"
                ) from None
    return cls(**(values | overrides))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PeerServerLimits:
    """What a sidecar's peer cache server allows a connection (module docstring)."""

    header_deadline_s: float = HEADER_DEADLINE_S
    body_deadline_s: float = BODY_DEADLINE_S
    send_deadline_s: float = SEND_DEADLINE_S
    max_connections: int = MAX_CONNECTIONS
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        _positive(self)
        if not isinstance(self.max_connections, int) or not isinstance(self.max_body_bytes, int):
            raise CheckpointError("peer cache limits max_connections, max_body_bytes: integers")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> PeerServerLimits:
        return _from_env(cls, env, overrides)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PeerClientLimits:
    """What a restore (or a replication round) allows the peers (module docstring)."""

    request_deadline_s: float = REQUEST_DEADLINE_S
    min_rate_bytes_s: float = MIN_RATE_BYTES_S
    locate_deadline_s: float = LOCATE_DEADLINE_S
    keepalive_s: float = KEEPALIVE_S
    restore_budget_s: float = RESTORE_BUDGET_S
    hit_allowance_s: float = HIT_ALLOWANCE_S
    fast_rate_bytes_s: float = FAST_RATE_BYTES_S

    def __post_init__(self) -> None:
        _positive(self)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> PeerClientLimits:
        return _from_env(cls, env, overrides)

    def deadline_s(self, nbytes: int) -> float:
        """The whole wall clock a request for ``nbytes`` of chunk may take."""
        return self.request_deadline_s + nbytes / self.min_rate_bytes_s

    def fair_s(self, nbytes: int) -> float:
        """What a hit of ``nbytes`` may take and waste nothing."""
        return self.hit_allowance_s + nbytes / self.fast_rate_bytes_s

    def bound_s(self, largest_range: int) -> float:
        """How much longer than a store-only restore a restore through the peers takes at
        most, whatever they do, when no range it reads is over ``largest_range`` bytes."""
        return self.restore_budget_s + max(self.locate_deadline_s, self.deadline_s(largest_range))


class WasteMeter:
    """Wall-clock time wasted on peers: the length of the union of the spans charged.

    Requests run on several threads at once; a second of five threads each waiting on
    a peer is one second of the restore's, so overlapping spans count once. Pure (the
    caller passes the times) and not thread-safe (the caller holds its lock)."""

    def __init__(self) -> None:
        self._starts: list[float] = []  # disjoint spans, sorted
        self._ends: list[float] = []
        self.spent = 0.0

    def charge(self, start: float, end: float) -> None:
        if end <= start:
            return
        first = bisect.bisect_left(self._ends, start)  # spans that end at or after start
        past = bisect.bisect_right(self._starts, end)  # ... and begin at or before end
        if first < past:
            start = min(start, self._starts[first])
            end = max(end, self._ends[past - 1])
            self.spent -= sum(
                e - s for s, e in zip(self._starts[first:past], self._ends[first:past], strict=True)
            )
        self._starts[first:past] = [start]
        self._ends[first:past] = [end]
        self.spent += end - start
