"""Prometheus metrics of the checkpoint engine: one place, base units, low-cardinality labels.

The trainer side records stall and restore; the persister (sidecar or the
in-process thread) records upload, commit, bytes, failures and last success.
Each component gets a ``CheckpointMetrics`` over a registry it is handed, so
tests use a fresh registry and processes can serve theirs on /metrics.

No series here names its job: in a cluster the chart's PodMonitor labels every sidecar
series with ``namespace`` and ``job_name`` (from the pod's job-name label), which stay the
same across the job's attempts while the pod names change.

``python -m trainer_sidecar.metrics wait-ready`` is the sidecar's startup probe: it waits,
inside the container, until /readyz answers 200, so a healthy start fails no probe (an
HTTP probe fails, and emits a Warning event, while the server is still importing).
"""

from __future__ import annotations

import argparse
import http.server
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence

from ctj_contract import Env
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from . import __version__

# from 1 ms (a stall) to ~17 min (a large upload)
_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1200,
)
FAILURE_STAGES = ("stage", "upload", "commit", "restore")
RESTORE_TIERS = ("local", "peer", "s3")  # load/tiers.py
BYTE_KINDS = ("logical", "uploaded", "deduplicated")
COMPONENT = "checkpoint"  # ctj_build_info's component (sidecar or in-process); the operator's


class CheckpointMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # set by a Checkpointer in sidecar mode: the trainer serves no /metrics there, so its
        # observations also go to the sidecar (slots.relay_observation), which exports them
        self.relay: Callable[[str, float, str], None] | None = None
        r = self.registry
        self.build_info = Gauge(
            "ctj_build_info",
            "Always 1: the version of ctj this process runs, and which component it is.",
            ["version", "component"],
            registry=r,
        )
        self.build_info.labels(version=__version__, component=COMPONENT).set(1)
        self.stall = Histogram(
            "ctj_checkpoint_stall_seconds",
            "Time a save blocked the training loop (until the state was staged), by rank.",
            ["rank"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.upload = Histogram(
            "ctj_checkpoint_upload_seconds",
            "Time to chunk, hash and upload one rank's staged checkpoint, by rank.",
            ["rank"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.commit = Histogram(
            "ctj_checkpoint_commit_seconds",
            "Time from a checkpoint being staged to its manifest being committed.",
            buckets=_BUCKETS,
            registry=r,
        )
        self.restore = Histogram(
            "ctj_checkpoint_restore_seconds",
            "Time to load a committed checkpoint into the training state, by rank.",
            ["rank"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.bytes = Counter(
            "ctj_checkpoint_bytes",
            "Checkpoint bytes by kind: logical (state size), uploaded, "
            "deduplicated (already stored, not sent).",
            ["kind"],
            registry=r,
        )
        self.last_success = Gauge(
            "ctj_checkpoint_last_success_timestamp_seconds",
            "Unix time of the last committed checkpoint.",
            registry=r,
        )
        self.failures = Counter(
            "ctj_checkpoint_failures",
            "Checkpoint failures by stage (restore counts fallbacks; upload and commit count"
            " each try the store did not answer, which the save makes again).",
            ["stage"],
            registry=r,
        )
        self.skipped = Counter(
            "ctj_checkpoint_skipped",
            "Saves skipped because the previous one was still uploading (policy skip).",
            registry=r,
        )
        self.interval = Gauge(
            "ctj_checkpoint_interval_seconds",
            "Time between the last two checkpoints committed (the job's checkpoint cadence).",
            registry=r,
        )
        self.last_step = Gauge(
            "ctj_checkpoint_last_committed_step",
            "Step of the last committed checkpoint.",
            registry=r,
        )
        self.restore_bytes = Counter(
            "ctj_checkpoint_restore_bytes",
            "Bytes a restore read, by tier: local (the node's cache), peer (another pod's "
            "cache), s3 (the object store).",
            ["tier"],
            registry=r,
        )
        self.gc_blocked = Gauge(
            "ctj_checkpoint_gc_blocked",
            "1 while retention or gc after a commit stops before deleting anything (a live "
            "checkpoint it cannot read, a store error): storage grows until it is fixed.",
            registry=r,
        )
        for tier in RESTORE_TIERS:
            self.restore_bytes.labels(tier=tier)
        for stage in FAILURE_STAGES:  # export zeros, so rates work from the start
            self.failures.labels(stage=stage)
        for kind in BYTE_KINDS:
            self.bytes.labels(kind=kind)

    # -- what the training process observes (in sidecar mode, relayed to the sidecar) --

    def observe_stall(self, seconds: float, rank: int) -> None:
        self.stall.labels(rank=str(rank)).observe(seconds)
        self._relay("stall", seconds)

    def observe_restore(self, seconds: float, rank: int) -> None:
        self.restore.labels(rank=str(rank)).observe(seconds)
        self._relay("restore", seconds)

    def observe_upload(self, seconds: float, rank: int) -> None:
        """The sidecar's (or the in-process persister's) own: never relayed."""
        self.upload.labels(rank=str(rank)).observe(seconds)

    def count_restore_bytes(self, by_tier: dict[str, int]) -> None:
        for tier, n in by_tier.items():
            self.restore_bytes.labels(tier=tier).inc(n)
            self._relay("restore_bytes", float(n), tier)

    def count_failure(self, stage: str) -> None:
        self.failures.labels(stage=stage).inc()
        self._relay("failure", 1.0, stage)

    def count_skipped(self) -> None:
        self.skipped.inc()
        self._relay("skipped", 1.0)

    def _relay(self, name: str, value: float, stage: str = "") -> None:
        if self.relay is not None:
            self.relay(name, value, stage)

    def apply(self, name: str, value: float, stage: str = "", rank: int = 0) -> None:
        """Record an observation trainer ``rank`` relayed (the sidecar's side; not relayed
        on). The per-rank histograms are labelled with it: one sidecar serves every rank
        of its pod (nprocPerNode), and a straggler shows as one rank."""
        if name == "stall":
            self.stall.labels(rank=str(rank)).observe(value)
        elif name == "restore":
            self.restore.labels(rank=str(rank)).observe(value)
        elif name == "failure" and stage in FAILURE_STAGES:
            self.failures.labels(stage=stage).inc(value)
        elif name == "skipped":
            self.skipped.inc(value)
        elif name == "restore_bytes" and stage in RESTORE_TIERS:
            self.restore_bytes.labels(tier=stage).inc(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class HeartbeatMetrics:
    """The operator's heartbeat asks this sidecar answered (trainer_sidecar/heartbeat.py),
    on the sidecar's registry (the library's processes do not beat)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.beats = Counter(
            "ctj_heartbeats",
            "Heartbeat asks from the operator this sidecar answered.",
            registry=registry,
        )
        self.refused = Counter(
            "ctj_heartbeats_refused",
            "Heartbeat asks refused (no or a wrong job token, a malformed body).",
            registry=registry,
        )


class StagingCollector:
    """The staging volume's room, read at each scrape (``os.statvfs``): in a pod, the
    memory-backed emptyDir whose sizeLimit bounds it; a save that does not fit fails."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = root

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            fs = os.statvfs(self.root)
        except OSError:
            return
        capacity = fs.f_blocks * fs.f_frsize
        used = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        yield GaugeMetricFamily(
            "ctj_staging_capacity_bytes", "Size of the staging volume.", value=capacity
        )
        yield GaugeMetricFamily(
            "ctj_staging_used_bytes", "Bytes in use on the staging volume.", value=used
        )


Response = tuple[int, str, bytes]
PostRoute = Callable[[bytes, "str | None"], Response]
"""(the request's body, its Authorization header) -> the response."""
MAX_POST_BYTES = 4096


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, Callable[[], Response]] = {}
    post_routes: dict[str, PostRoute] = {}
    timeout = 10  # a client that sends headers and no body holds a thread no longer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        route = self.routes.get(self.path.split("?")[0])
        self._send(*(route() if route else (404, "text/plain", b"not found\n")))

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        route = self.post_routes.get(self.path.split("?")[0])
        try:
            length = int(self.headers.get("Content-Length") or "0")
        except ValueError:
            length = -1
        if route is None:
            self._send(404, "text/plain", b"not found\n")
        elif not 0 <= length <= MAX_POST_BYTES:
            self.close_connection = True  # the body is not read: the connection is done
            self._send(413, "text/plain", f"at most {MAX_POST_BYTES} bytes\n".encode())
        else:
            self._send(*route(self.rfile.read(length), self.headers.get("Authorization")))

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # probes every few seconds would drown the log


def serve(
    port: int,
    metrics: CheckpointMetrics,
    *,
    healthy: Callable[[], bool] = lambda: True,
    ready: Callable[[], bool] = lambda: True,
    host: str = "0.0.0.0",
    post_routes: Mapping[str, PostRoute] | None = None,
) -> http.server.ThreadingHTTPServer:
    """/metrics, /healthz and /readyz on a daemon thread; port 0 picks a free one.
    ``post_routes``: more paths, POSTed to (the heartbeat's)."""

    def probe(check: Callable[[], bool]) -> Callable[[], tuple[int, str, bytes]]:
        return lambda: (200, "text/plain", b"ok\n") if check() else (503, "text/plain", b"no\n")

    handler = type(
        "Handler",
        (_Handler,),
        {
            "routes": {
                "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics.exposition()),
                "/healthz": probe(healthy),
                "/readyz": probe(ready),
            },
            "post_routes": dict(post_routes or {}),
        },
    )
    server = http.server.ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ctj-metrics", daemon=True).start()
    return server


def wait_ready(url: str, timeout_s: float, *, poll_s: float = 0.2) -> bool:
    """Whether ``url`` answers 200 within ``timeout_s``: a refused connection (the server
    is not listening yet) and a 503 (not ready yet) are asked again until then."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with urllib.request.urlopen(url, timeout=max(0.1, min(left, 2.0))) as response:
                if response.status == 200:
                    return True
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def main(argv: Sequence[str] | None = None) -> int:
    """``wait-ready``: the sidecar's startup probe (exit 0 once /readyz answers 200)."""
    parser = argparse.ArgumentParser(prog="python -m trainer_sidecar.metrics")
    sub = parser.add_subparsers(dest="command", required=True)
    ready = sub.add_parser("wait-ready", help="wait until this container's /readyz is 200")
    ready.add_argument("--port", type=int, required=True)
    ready.add_argument(
        "--host", default=None, help="default: CTJ_METRICS_HOST (the pod IP), else 127.0.0.1"
    )
    ready.add_argument("--timeout", type=float, required=True, help="seconds to wait at most")
    args = parser.parse_args(argv)
    host = args.host or os.environ.get(Env.METRICS_HOST) or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 pod IP
    if wait_ready(f"http://{host}:{args.port}/readyz", args.timeout):
        return 0
    print(f"/readyz on {host}:{args.port} not ready within {args.timeout:g}s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
