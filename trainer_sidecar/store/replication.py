"""Peer replication: each node's cache also holds its neighbour's share of the last commit.

A node-local cache alone cannot help the rank that replaces a lost node: the
chunks it needs were on that node. So after each commit the sidecar of pod
``i`` copies the chunks of pod ``i + 1``'s ranks (mod the pods) from that pod's
cache into its own, over the peer protocol (store/peers.py), verified block by
block. A single lost node's share is then still on a survivor, and a restore
after it reads nothing from S3 (GKE's multi-tier checkpointing replicates to a
peer the same way). It costs each node about twice its share of cache space and
a LAN copy of each new chunk; an incremental save copies only what changed.

It runs on its own thread, never in the way of a save: only the newest save
waits for its commit, one that comes meanwhile replaces it; a neighbour that is
down or lacks a chunk is skipped (the restore's own tiers still fall back to S3).
Each round asks the neighbour afresh (``round_peers``), with the peer client's
deadlines (store/peer_limits.py): a neighbour that is slow, silent or sends too
much misses within its request's deadline, and is not asked again that round.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from ..errors import CheckpointError
from ..format.chunking import blocks_match
from ..format.manifest import METADATA_FILE, ChunkRef, Manifest, SaveIdentity
from . import commit as commits
from .base import ObjectStore
from .chunk_cache import NodeChunks
from .peers import PeerCaches

log = logging.getLogger(__name__)


def neighbour_chunks(manifest: Manifest, own: int, pods: int) -> list[ChunkRef]:
    """The chunks of pod ``own + 1``'s ranks (mod ``pods``) in ``manifest``, each once;
    none when there is no other pod or the ranks do not divide evenly among the pods."""
    if pods < 2 or manifest.world_size % pods:
        return []
    per_pod = manifest.world_size // pods
    neighbour = (own + 1) % pods
    ranks = range(neighbour * per_pod, (neighbour + 1) * per_pod)
    prefixes = tuple(f"__{r}_" for r in ranks)
    chosen: dict[str, ChunkRef] = {}
    # names first (a version 3 manifest lists them without reading any rank manifest), so
    # only the neighbour's rank manifests are fetched
    for name in sorted(manifest.files):
        if name.startswith(prefixes) or (name == METADATA_FILE and neighbour == 0):
            for chunk in manifest.files[name].chunks:
                chosen.setdefault(chunk.id, chunk)
    return list(chosen.values())


def round_peers(peers: PeerCaches) -> PeerCaches:
    """A fresh client for one round: what the neighbour did in the last one is forgotten
    (a neighbour that was down may be back). The restore's waste budget does not apply:
    a round has no other source to fall back on, and it runs beside the job, not in its
    way; each request's deadline, and dropping a neighbour that misses, bound it."""
    return peers.renewed(restore_budget_s=math.inf)


def replicate(
    manifest: Manifest, cache: NodeChunks, peers: PeerCaches, *, own: int, pods: int
) -> int:
    """Copy the neighbour's missing chunks into ``cache``; the bytes copied."""
    share = neighbour_chunks(manifest, own, pods)
    held = cache.held(c.id for c in share) if share else set()
    wanted = [c for c in share if c.id not in held]
    if not wanted:
        return 0
    peers.locate(c.id for c in wanted)
    copied = 0
    for chunk in wanted:
        data = peers.read(chunk.id, 0, chunk.size)
        if data is None:
            continue
        if not blocks_match(data, chunk.blocks, 0, manifest.block_size):
            peers.reject(chunk.id)
            log.warning("peer replication: chunk %s fails its hash check; skipped", chunk.id[:16])
            continue
        cache.keep(chunk.id, data)
        copied += len(data)
    return copied


class Replicator:
    """``replicate`` for the newest commit, on a thread of its own; ``stop`` joins it.

    Every sidecar learns of a commit the same way: it stored its part of a save
    (``saved``), then reads what became of that save (commit.outcome) with a backoff,
    until it committed (replicate), failed, or a newer save came."""

    def __init__(
        self,
        store: ObjectStore,
        cache: NodeChunks,
        peers: PeerCaches,
        *,
        own: int,
        pods: int,
        give_up_s: float = 600.0,
    ) -> None:
        self.store, self.cache, self.peers, self.own, self.pods = store, cache, peers, own, pods
        self.give_up_s = give_up_s
        self.copied = 0
        self.done_step: int | None = None
        self._next: tuple[int, SaveIdentity] | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ctj-replicate", daemon=True)
        self._thread.start()

    def saved(self, step: int, save: SaveIdentity) -> None:
        with self._cond:
            if self.done_step is None or step > self.done_step:
                self._next = (step, save)
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._next is not None)
                if self._stop:
                    return
                assert self._next is not None
                step, save = self._next
                self._next = None
            manifest = self._await_commit(step, save)
            if manifest is None:
                continue
            try:
                peers = round_peers(self.peers)
                n = replicate(manifest, self.cache, peers, own=self.own, pods=self.pods)
            except Exception as exc:  # noqa: BLE001 - an optimisation: never the save's failure
                log.warning("peer replication of step %d failed: %s", step, exc)
                continue
            with self._cond:
                self.copied += n
                self.done_step = step
                self._cond.notify_all()
            if n:
                log.info("peer replication: %d bytes of step %d's neighbour share", n, step)

    def _await_commit(self, step: int, save: SaveIdentity) -> Manifest | None:
        """The save's manifest once committed; None if it failed, a newer save came, we
        stop, or it stays undecided past ``give_up_s``."""
        deadline = time.monotonic() + self.give_up_s
        delay = 0.5
        while time.monotonic() < deadline:
            try:
                result = commits.outcome(self.store, step, save)
            except CheckpointError as exc:
                log.debug("peer replication: step %d: %s", step, exc)
                result = None
            if isinstance(result, Manifest):
                return result
            if result is not None:  # SaveFailed
                return None
            with self._cond:
                if self._cond.wait_for(lambda: self._stop or self._next is not None, delay):
                    return None
            delay = min(delay * 2, 30.0)
        return None

    def wait_for(self, step: int, timeout: float) -> bool:
        """True once step (or a later one) is replicated (for tests and benchmarks)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.done_step is not None and self.done_step >= step, timeout
            )

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(10)
