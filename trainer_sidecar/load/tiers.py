"""Where a restore reads a chunk from: the node's cache, then a peer's, then the store.

A restarted attempt's ranks mostly need what their nodes already hold (the
node-local cache the uploader keeps: in a pod the node agent's, reached through
store/agent_client.py; else a directory, store/chunk_cache.py), and a rank on a
new node can read from its peers' caches (store/peers.py) before S3. The
reader (chunk_reader.py) checks every block a tier returns against the
manifest; a tier whose bytes fail is told (its entry dropped) and the next
tier is tried, so a damaged cache costs a refetch, never a fallback to an
older checkpoint. Every byte is counted by the tier it came from
(``ctj_checkpoint_restore_bytes_total{tier}``).

The peers cannot hold a restore up: each request to one has a wall-clock deadline
and reads no more than it asked for, a peer that misses is not asked again, and
once the peers have wasted a rank its budget none is asked (one ``PeerCaches`` per
rank and restore: store/peer_limits.py). Each rank's reads through the tiers are so
at most ``PeerClientLimits.bound_s`` slower than from the store alone, and a whole
restore at most ``restore_bound_s`` (12 s per checkpoint tried, with the defaults
and 8 MiB chunks), whatever the peers do.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Iterator

from ..format.manifest import ChunkRef
from ..store.chunk_cache import NodeChunks
from ..store.peer_limits import PeerClientLimits
from ..store.peers import PeerCaches

log = logging.getLogger("ctj.checkpoint")


PEER_PHASES = 2
"""The reads through the tiers that a restore's ranks wait on one after the other, per
checkpoint tried (load/restore.py): rank 0's of the checkpoint's metadata, which the
others wait for, then every rank's of its own state, in parallel."""


def restore_bound_s(
    limits: PeerClientLimits, largest_range: int, checkpoints_tried: int = 1
) -> float:
    """At most how much longer a restore through the tiers takes than one from the store
    alone, whatever the peers do. Each rank's peers waste it at most ``limits.bound_s``
    (``largest_range``: the chunk size, the most a read asks for), and in each phase the
    ranks wait for the slowest: so at most that per phase."""
    return PEER_PHASES * checkpoints_tried * limits.bound_s(largest_range)


class Tier(enum.StrEnum):
    """Where a chunk's bytes came from (the ``tier`` label of the restore metrics)."""

    LOCAL = "local"
    PEER = "peer"
    STORE = "s3"


@dataclasses.dataclass
class ChunkTiers:
    cache: NodeChunks | None = None
    peers: PeerCaches | None = None

    def prepare(self, chunks: Iterable[ChunkRef]) -> None:
        """Before a batch of reads: find which peers hold what the node does not."""
        if self.peers is None:
            return
        ids = [c.id for c in chunks]
        held = self.cache.held(ids) if self.cache is not None and ids else set()
        self.peers.locate(i for i in ids if i not in held)

    def candidates(self, chunk: ChunkRef, start: int, end: int) -> Iterator[tuple[Tier, bytes]]:
        """(tier, raw bytes [start, end)) from each tier that has them, nearest first."""
        if self.cache is not None:
            data = self.cache.read(chunk.id, start, end)
            if data is not None:
                yield Tier.LOCAL, data
        if self.peers is not None:
            data = self.peers.read(chunk.id, start, end)
            if data is not None:
                yield Tier.PEER, data

    def reject(self, tier: Tier, chunk: ChunkRef) -> None:
        log.warning(
            "chunk %s from the %s cache fails its hash check: dropped it, reading it elsewhere",
            chunk.id[:16], "node's" if tier == Tier.LOCAL else "peers'",
        )  # fmt: skip
        if tier == Tier.LOCAL and self.cache is not None:
            self.cache.discard(chunk.id)
        elif tier == Tier.PEER and self.peers is not None:
            self.peers.reject(chunk.id)

    def keep(self, chunk: ChunkRef, raw: bytes | memoryview) -> None:
        """A whole chunk read from the store, verified: the node holds it from now on."""
        if self.cache is not None:
            self.cache.keep(chunk.id, raw)
