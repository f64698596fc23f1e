"""The sidecar daemon: persists what the pod's trainer processes stage.

It runs beside the trainer in the pod (``ctj sidecar``), sharing the
memory-backed staging volume. It uploads every staged checkpoint of every rank
in the pod and, for rank 0, commits the manifest once all ranks' parts are in
the store. It does not depend on the trainer being alive: a checkpoint staged
just before the trainer crashed still commits. On SIGTERM it stops taking new
work, finishes what is staged within the grace, and exits; past the grace it
leaves staged checkpoints for its next start and commits nothing partial.

Serves /metrics, /healthz (the persist loop is alive) and /readyz (the store
answered) when given a port.

Given heartbeat settings (the job's token, in a pod the operator made), it answers the
operator's heartbeat on the metrics port, from start-up until ``run()`` returns, SIGTERM
grace included: the operator sees a dead rank in seconds, reads rank 0's last commit
from it, and asks for a checkpoint through it (heartbeat.py).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from ctj_contract import HEARTBEAT_PATH
from ctj_contract.launch import launch_dir

from . import __version__
from . import heartbeat as heartbeats
from .config import CheckpointConfig, job_staging_dir
from .errors import CheckpointError
from .metrics import CheckpointMetrics, HeartbeatMetrics, PostRoute, StagingCollector, serve
from .parts import Parts
from .save import slots
from .signals import SignalThread
from .store.chunk_cache import ChunkCache
from .store.peers import own_index, serve_cache
from .store.replication import Replicator

log = logging.getLogger("ctj.sidecar")


def _replicator(parts: Parts) -> Replicator | None:
    """Peer replication (store/replication.py), where this pod has a cache, peers, and
    finds itself among them."""
    config, peers = parts.config, parts.peers()
    if parts.cache is None or peers is None:
        return None
    own = own_index(config.cache_peers)
    if own is None:
        log.warning("this pod is not among CTJ_CACHE_PEERS: no peer replication")
        return None
    return Replicator(
        parts.store, parts.cache, peers, own=own, pods=len(config.cache_peers),
        give_up_s=config.commit_timeout_s,
    )  # fmt: skip


def _start_up_failed() -> None:
    """What reading the latest commit at start-up does on anything but a store not there
    yet: what a bucket writer stored (a record no check refused, a MemoryError parsing
    it) or a bug. Retrying would meet it again and exiting would crash-loop the pod, and
    with it every later save; so the sidecar says so loudly and persists anyway. Only the
    trainer's hint is lost (state.json): it plans its next save from the store itself."""
    log.exception(
        "cannot read the latest committed checkpoint at start-up; persisting anyway "
        "(the trainer plans its next save from the store)"
    )


def run(
    config: CheckpointConfig,
    *,
    metrics_port: int | None,
    grace_s: float,
    metrics_host: str = "0.0.0.0",
    heartbeat: heartbeats.HeartbeatSettings | None = None,
) -> int:
    parts = Parts.open(config)
    root = job_staging_dir(config)
    slots.prepare_root(root)
    metrics = CheckpointMetrics()
    metrics.registry.register(StagingCollector(root))
    replicator = _replicator(parts)
    persister = parts.persister(
        root=root,
        metrics=metrics,
        versions={"ctj": __version__},
        on_stored=replicator.saved if replicator is not None else None,
    )
    stop = threading.Event()

    def on_signal(signum: int) -> None:
        log.info(
            "got %s: finishing staged checkpoints (grace %.1fs)",
            signal.Signals(signum).name,
            grace_s,
        )
        persister.shutdown(stop, grace_s)

    with SignalThread((signal.SIGTERM, signal.SIGINT), on_signal):
        ready = threading.Event()
        server = None
        post_routes: dict[str, PostRoute] = {}
        if heartbeat is not None:
            endpoint = heartbeats.HeartbeatEndpoint(
                heartbeat,
                latest=persister.latest_committed,
                root=root,
                launch=launch_dir(config.staging_dir),
                on_ended=persister.attempt_ended,
                metrics=HeartbeatMetrics(metrics.registry),
            )
            post_routes[HEARTBEAT_PATH] = endpoint.handle
        if metrics_port is not None:
            server = serve(
                metrics_port,
                metrics,
                healthy=lambda: not stop.is_set(),
                ready=ready.is_set,
                host=metrics_host,
                post_routes=post_routes,
            )
            paths = ", ".join(["/metrics", "/healthz", "/readyz", *post_routes])
            log.info("serving %s on port %d", paths, server.server_address[1])
        elif heartbeat is not None:
            log.warning("no metrics port: the operator's heartbeat has nowhere to ask")
        peer_server = None
        if parts.cache is not None and config.cache_port is not None and config.cache_token:
            # with a node agent, the peers read from it: this pod only says where it is
            peer_server = serve_cache(
                parts.cache if isinstance(parts.cache, ChunkCache) else None,
                token=config.cache_token, host=metrics_host, port=config.cache_port,
                node_agent=config.node_agent,
            )  # fmt: skip
            log.info("serving the node's chunk cache to the job's peers on port %d",
                     peer_server.server_address[1])  # fmt: skip
        log.info("persisting %s staged under %s to %s", config.mode, root, config.uri)
        delay = 0.5
        while not stop.is_set() and not ready.is_set():
            try:
                persister.publish_latest()
                ready.set()
            except CheckpointError as exc:  # the store is not there yet: say so, keep trying
                log.error("%s (retrying)", exc)
                stop.wait(delay)
                delay = min(delay * 2, 10.0)
            except Exception:  # noqa: BLE001 - see _start_up_failed
                _start_up_failed()
                ready.set()
        started = time.monotonic()
        persister.run(stop, grace_s=grace_s)
        left = [s.step for _, s in slots.pending(root)]
        if server is not None:
            server.shutdown()
        if peer_server is not None:
            peer_server.shutdown()
            peer_server.server_close()
        if replicator is not None:
            replicator.stop()
        if left:
            log.warning(
                "exiting with steps %s staged but not committed (after %.1fs)",
                sorted(set(left)),
                time.monotonic() - started,
            )
            return 1
        log.info("exiting: nothing left staged")
        return 0
