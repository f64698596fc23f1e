"""The composition root: the engine's parts made from a config, in one place.

The training library (``Checkpointer``), the sidecar daemon and the ``ctj`` CLI each need
a store, and the first two the node's chunk cache, the peers' caches and a persister.
They are made here, so each entry point asks for what it uses and none wires the store
or the caches its own way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from .config import CheckpointConfig
from .format.manifest import SaveIdentity
from .load.tiers import ChunkTiers
from .metrics import CheckpointMetrics
from .save.persist import Persister
from .store.agent_client import AgentCache, job_path
from .store.base import ObjectStore
from .store.chunk_cache import ChunkCache, NodeChunks
from .store.peers import PeerCaches
from .store.s3 import S3Settings, open_store


def job_store(
    uri: str, *, endpoint_url: str | None = None, region: str | None = None
) -> ObjectStore:
    """The store at ``uri`` (s3:// with S3's settings from the environment, or file://)."""
    return open_store(uri, S3Settings.from_env(endpoint_url=endpoint_url, region=region))


def job_path_of(config: CheckpointConfig) -> str:
    """The job's path on the node agents (the config holds all three parts with an agent)."""
    ns, name, uid = config.job_namespace, config.job_name, config.job_uid
    assert ns is not None and name is not None and uid is not None
    return job_path(ns, name, uid)


@dataclasses.dataclass(frozen=True, slots=True)
class Parts:
    """What a process of a job reads and writes through."""

    config: CheckpointConfig
    store: ObjectStore
    cache: NodeChunks | None
    """The node-local chunk cache: the node agent's (CTJ_NODE_AGENT_HOST, in a pod), else a
    directory (CTJ_CACHE_DIR), where there is one."""

    @classmethod
    def open(cls, config: CheckpointConfig, *, store: ObjectStore | None = None) -> Parts:
        """``store``: one the caller made (tests, a wrapped store); else the config's."""
        if store is None:
            store = job_store(config.uri, endpoint_url=config.endpoint_url, region=config.region)
        cache: NodeChunks | None = None
        if config.node_agent is not None:
            assert config.cache_token is not None  # the config checked it
            cache = AgentCache(
                config.node_agent, job_path_of(config), token=config.cache_token,
                mount=config.node_cache_mount,
            )  # fmt: skip
        elif config.cache_dir:
            cache = ChunkCache(config.cache_dir, config.cache_max_bytes)
        return cls(config, store, cache)

    def peers(self) -> PeerCaches | None:
        """A client of the peers' caches (fresh: it remembers which peer holds what)."""
        if not self.config.cache_peers or not self.config.cache_token:
            return None
        path = job_path_of(self.config) if self.config.node_agent is not None else None
        return PeerCaches(self.config.cache_peers, token=self.config.cache_token, job_path=path)

    def tiers(self) -> ChunkTiers | None:
        """Where a restore reads before the store: the node's cache, then the peers'."""
        peers = self.peers()
        if self.cache is None and peers is None:
            return None
        return ChunkTiers(cache=self.cache, peers=peers)

    def persister(
        self,
        *,
        root: Path,
        metrics: CheckpointMetrics,
        versions: dict[str, str],
        rank: int | None = None,
        on_stored: Callable[[int, SaveIdentity], None] | None = None,
    ) -> Persister:
        """Uploads and commits what is staged under ``root`` (the sidecar's job, or a
        thread's in the training process)."""
        return Persister(
            self.store,
            self.config,
            root=root,
            metrics=metrics,
            rank=rank,
            versions=versions,
            cache=self.cache,
            on_stored=on_stored,
        )
