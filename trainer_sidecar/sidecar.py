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

Given heartbeat settings (CTJ_HEARTBEAT_LEASE, in a pod the operator made), it renews
the pod's Lease on a thread of its own, from start-up until ``run()`` returns, SIGTERM
grace included: the operator sees a dead rank in seconds, reads rank 0's last commit
from it, and asks for a checkpoint through it (heartbeat.py).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from . import __version__
from . import heartbeat as heartbeats
from .config import CheckpointConfig, job_staging_dir
from .errors import CheckpointError
from .metrics import CheckpointMetrics, HeartbeatMetrics, StagingCollector, serve
from .save import slots
from .save.persist import Persister
from .store.s3 import S3Settings, open_store

log = logging.getLogger("ctj.sidecar")


def run(
    config: CheckpointConfig,
    *,
    metrics_port: int | None,
    grace_s: float,
    metrics_host: str = "0.0.0.0",
    heartbeat: heartbeats.HeartbeatSettings | None = None,
) -> int:
    store = open_store(
        config.uri, S3Settings.from_env(endpoint_url=config.endpoint_url, region=config.region)
    )
    root = job_staging_dir(config)
    slots.prepare_root(root)
    metrics = CheckpointMetrics()
    metrics.registry.register(StagingCollector(root))
    persister = Persister(store, config, root=root, metrics=metrics, versions={"ctj": __version__})
    stop = threading.Event()
    ready = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info(
            "got %s: finishing staged checkpoints (grace %.1fs)",
            signal.Signals(signum).name,
            grace_s,
        )
        persister.shutdown(stop, grace_s)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = None
    if metrics_port is not None:
        server = serve(
            metrics_port,
            metrics,
            healthy=lambda: not stop.is_set(),
            ready=ready.is_set,
            host=metrics_host,
        )
        log.info("serving /metrics, /healthz, /readyz on port %d", server.server_address[1])
    log.info("persisting %s staged under %s to %s", config.mode, root, config.uri)
    beat = None
    if heartbeat is not None:
        beat = heartbeats.start(
            heartbeat,
            root=root,
            latest=persister.latest_committed,
            metrics=HeartbeatMetrics(metrics.registry),
            on_gone=persister.attempt_ended,
        )
    try:
        delay = 0.5
        while not stop.is_set() and not ready.is_set():
            try:
                persister.publish_latest()
                ready.set()
            except CheckpointError as exc:  # the store is not there yet: say so, keep trying
                log.error("%s (retrying)", exc)
                stop.wait(delay)
                delay = min(delay * 2, 10.0)
        started = time.monotonic()
        persister.run(stop, grace_s=grace_s)
    finally:
        if beat is not None:
            beat.stop()  # joined: no thread of ours outlives run()
    left = [s.step for _, s in slots.pending(root)]
    if server is not None:
        server.shutdown()
    if left:
        log.warning(
            "exiting with steps %s staged but not committed (after %.1fs)",
            sorted(set(left)),
            time.monotonic() - started,
        )
        return 1
    log.info("exiting: nothing left staged")
    return 0
