"""``ctj agent`` / ``python -m trainer_sidecar agent``: the node agent's entry point.

Reads its settings from flags (each with a CTJ_AGENT_* default), the cluster key from
its mounted file, and runs until SIGTERM: the server (server.py) and the collector of
deleted jobs' data (gc.py) on threads of their own.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import threading
from pathlib import Path

from ctj_contract.tokens import read_key

from ..signals import SignalThread
from .gc import Collector, FileJobLister, KubeJobLister
from .server import serve_agent
from .store import NodeStore

log = logging.getLogger("ctj.agent")

DEFAULT_PORT = 9403
_QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?")
_FACTOR = {None: 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}  # fmt: skip


def parse_bytes(value: str) -> int:
    """``20Gi``, ``500M``, ``1048576``: bytes (Kubernetes' binary and decimal suffixes)."""
    match = _QUANTITY.fullmatch(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a size: use e.g. 100Gi")
    return int(match[1]) * _FACTOR[match[2]]


def _add_root(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root",
        default=os.environ.get("CTJ_AGENT_ROOT", "/var/lib/ctj/cache"),
        help="the cache's directory on the node, as this container sees it (CTJ_AGENT_ROOT)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    _add_root(parser)
    parser.add_argument(
        "--max-bytes",
        default=env("CTJ_AGENT_MAX_BYTES", "20Gi"),
        help="the node's bound across all jobs (CTJ_AGENT_MAX_BYTES)",
    )
    parser.add_argument(
        "--key-file",
        default=env("CTJ_AGENT_KEY_FILE", "/etc/ctj/key/key"),
        help="the cluster key the job tokens derive from (CTJ_AGENT_KEY_FILE)",
    )
    parser.add_argument("--host", default=env("CTJ_AGENT_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env("CTJ_AGENT_PORT", DEFAULT_PORT)))
    parser.add_argument(
        "--gc-period",
        type=float,
        default=float(env("CTJ_AGENT_GC_PERIOD_S", "10")),
        help="seconds between lists of the live jobs (CTJ_AGENT_GC_PERIOD_S)",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="list jobs only in these namespaces (a namespaced install)",
    )
    parser.add_argument(
        "--jobs-file",
        help="list the live jobs' uids from this JSON file "
        '({"uids": [...]}) instead of the API server (tests; no Kubernetes)',
    )
    parser.add_argument("--no-gc", action="store_true",
                        help="never remove a job's data (no API access)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        key = read_key(args.key_file)
        max_bytes = parse_bytes(args.max_bytes)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    store = NodeStore(args.root, max_bytes)
    server = serve_agent(store, key=key, host=args.host, port=args.port)
    log.info(
        "serving the node cache %s (%d of %d bytes held) on port %d",
        args.root, store.bytes_held, max_bytes, server.server_address[1],
    )  # fmt: skip
    collector = None
    if args.jobs_file and not args.no_gc:
        collector = Collector(store, FileJobLister(args.jobs_file), period_s=args.gc_period)
        collector.start()
    elif not args.no_gc:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            log.error("not in a cluster (no KUBERNETES_SERVICE_HOST): run with --no-gc")
            return 2
        address = f"[{host}]" if ":" in host else host
        lister = KubeJobLister(f"https://{address}:{port}", namespaces=args.namespace)
        collector = Collector(store, lister, period_s=args.gc_period).start()
    stop = threading.Event()
    with SignalThread((signal.SIGTERM, signal.SIGINT), lambda _: stop.set()):
        stop.wait()
    log.info("stopping")
    if collector is not None:
        collector.stop()
    server.shutdown()
    server.server_close()
    return 0


def add_mounter_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    _add_root(parser)
    parser.add_argument(
        "--kubelet-dir",
        default=env("CTJ_AGENT_KUBELET_DIR", "/var/lib/kubelet"),
        help="the kubelet's root directory, mounted at the same path (CTJ_AGENT_KUBELET_DIR)",
    )
    parser.add_argument(
        "--node-id",
        default=env("CTJ_AGENT_NODE_NAME", ""),
        help="this node's name (CTJ_AGENT_NODE_NAME: the downward API's spec.nodeName)",
    )
    parser.add_argument(
        "--owner",
        default=env("CTJ_AGENT_OWNER", "65532:65532"),
        help="uid:gid of the agent's server, which writes the directories made here",
    )


def run_mounter(args: argparse.Namespace) -> int:
    from .csi import NodeCacheDriver, serve  # needs grpcio, which the server does not

    try:
        uid, gid = (int(part) for part in args.owner.split(":"))
    except ValueError:
        log.error("--owner %r: use uid:gid, e.g. 65532:65532", args.owner)
        return 2
    if not args.node_id:
        log.error("no node name: set --node-id or CTJ_AGENT_NODE_NAME (spec.nodeName)")
        return 2
    driver = NodeCacheDriver(
        root=Path(args.root), kubelet_dir=Path(args.kubelet_dir), node_id=args.node_id,
        owner=(uid, gid),
    )  # fmt: skip
    servers = serve(driver)
    stop = threading.Event()
    with SignalThread((signal.SIGTERM, signal.SIGINT), lambda _: stop.set()):
        stop.wait()
    log.info("stopping")
    for server in reversed(servers):
        server.stop(grace=5).wait()
    return 0
