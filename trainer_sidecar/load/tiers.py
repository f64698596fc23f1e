"""Where a restore reads a chunk from: the node's cache, then a peer's, then the store.

A restarted attempt's ranks mostly need what their nodes already hold (the
node-local cache the uploader keeps, store/chunk_cache.py), and a rank on a
new node can read from its peers' caches (store/peers.py) before S3. The
reader (chunk_reader.py) checks every block a tier returns against the
manifest; a tier whose bytes fail is told (its entry dropped) and the next
tier is tried, so a damaged cache costs a refetch, never a fallback to an
older checkpoint. Every byte is counted by the tier it came from
(``ctj_checkpoint_restore_bytes_total{tier}``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Iterator

from ..format.manifest import ChunkRef
from ..store.chunk_cache import ChunkCache
from ..store.peers import PeerCaches

log = logging.getLogger("ctj.checkpoint")



class Tier(enum.StrEnum):
    """Where a chunk's bytes came from (the ``tier`` label of the restore metrics)."""

    LOCAL = "local"
    PEER = "peer"
    STORE = "s3"



@dataclasses.dataclass
class ChunkTiers:
    cache: ChunkCache | None = None
    peers: PeerCaches | None = None

    def prepare(self, chunks: Iterable[ChunkRef]) -> None:
        """Before a batch of reads: find which peers hold what the node does not."""
        if self.peers is None:
            return
        missing = [c.id for c in chunks if self.cache is None or self.cache.size_of(c.id) is None]
        self.peers.locate(missing)

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

    def keep(self, chunk: ChunkRef, raw: bytes) -> None:
        """A whole chunk read from the store, verified: the node holds it from now on."""
        if self.cache is not None:
            self.cache.keep(chunk.id, raw)
