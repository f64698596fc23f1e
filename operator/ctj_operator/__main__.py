"""``python -m ctj_operator``: run the operator (in a pod, or against a kubeconfig).

kopf's watch timeouts are set here: a watch the server silently stops feeding
is kopf's best-known failure, so every watch is ended by the server after
``--watch-timeout`` seconds and re-opened, and a client-side timeout backs it up.

Leader election (leader.py) comes first: a standby replica answers its liveness probe
and waits for the Lease before kopf starts; a leader that cannot renew exits.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import logging
import os
import sys
import threading
from typing import Any

import kopf
from ctj_contract import GROUP
from kubernetes import client, config

from . import handlers
from .apply import Api
from .builders import DEFAULT_SIDECAR_IMAGE
from .leader import ElectionConfig, LeaderElection
from .quantities import parse_quantity
from .runtime import Operator, OperatorConfig
from .spec import NodeCache, SpecError

log = logging.getLogger("ctj.operator")


def _api_client(kubeconfig: str | None) -> client.ApiClient:
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _node_cache(parser: argparse.ArgumentParser, args: argparse.Namespace) -> NodeCache | None:
    if not args.node_cache_path:
        return None
    try:
        return NodeCache(args.node_cache_path, int(parse_quantity(args.node_cache_size)))
    except (ValueError, SpecError) as exc:
        parser.error(f"--node-cache-path/--node-cache-size: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctj-operator")
    parser.add_argument("--kubeconfig", help="default: in-cluster, then ~/.kube/config")
    parser.add_argument(
        "--namespace", action="append", help="watch only these namespaces (default: all)"
    )
    parser.add_argument("--metrics-port", type=int, default=8080)
    parser.add_argument(
        "--sidecar-image",
        default=os.environ.get("CTJ_SIDECAR_IMAGE") or DEFAULT_SIDECAR_IMAGE,
        help="checkpoint sidecar image for jobs that name none (default: CTJ_SIDECAR_IMAGE, "
        f"else {DEFAULT_SIDECAR_IMAGE}: the Dockerfile's sidecar target)",
    )
    parser.add_argument(
        "--node-cache-path",
        default=os.environ.get("CTJ_NODE_CACHE_PATH") or None,
        help="hostPath root of the node-local chunk cache (a directory per job under it); "
        "unset: no node cache (default: CTJ_NODE_CACHE_PATH)",
    )
    parser.add_argument(
        "--node-cache-size",
        default=os.environ.get("CTJ_NODE_CACHE_SIZE") or "20Gi",
        help="each job's node cache bound per node (default: CTJ_NODE_CACHE_SIZE, else 20Gi)",
    )
    parser.add_argument("--watch-timeout", type=float, default=60.0)
    parser.add_argument("--liveness-port", type=int, default=8081)
    parser.add_argument(
        "--leader-election-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="where the leader Lease lives (default: POD_NAMESPACE, else default)",
    )
    parser.add_argument("--leader-election-name", default="ctj-operator")
    parser.add_argument(
        "--no-leader-election", action="store_true", help="act at once (a single replica)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # "Timer succeeded" each second
    api = _api_client(args.kubeconfig)
    if _has_pytorchjobs(api):
        handlers.register_pytorchjobs()
    config = OperatorConfig(
        sidecar_image=args.sidecar_image or DEFAULT_SIDECAR_IMAGE,
        node_cache=_node_cache(parser, args),
    )
    op = Operator(api=Api.connect(api), config=config)
    from prometheus_client import start_http_server

    start_http_server(args.metrics_port, registry=op.metrics.registry)  # a standby's too
    if not args.no_leader_election:
        leader = LeaderElection(
            client.CoordinationV1Api(api),
            ElectionConfig(
                namespace=args.leader_election_namespace, name=args.leader_election_name
            ),
        )
        with _standby_liveness(args.liveness_port):
            leader.acquire()
        op.leader = leader
        leader.keep(on_lost=lambda: os._exit(1))  # client-go's way: never act unsure

    @kopf.on.startup()
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = int(args.watch_timeout)
        settings.watching.client_timeout = int(args.watch_timeout) + 30
        settings.watching.connect_timeout = 10
        settings.networking.request_timeout = 30
        settings.posting.level = logging.INFO
        settings.execution.max_workers = 32  # reconciles block on API calls; jobs are many
        settings.persistence.finalizer = f"{GROUP}/operator"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.scanning.disabled = True  # no CRD/namespace watching: least privilege
        # a deleted job keeps kopf's finalizer until its reconcile timer has stopped; a
        # timer caught mid-run is otherwise polled again only after 60 s
        settings.background.instant_exit_timeout = 0.5
        settings.background.cancellation_polling = 1.0

    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig

        @kopf.on.login()
        def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
            return kopf.login_with_kubeconfig(**kwargs)  # reads KUBECONFIG when called

    if op.leader is not None:
        stop_leader = op.leader.release

        @kopf.on.cleanup()
        def release(**_: Any) -> None:
            stop_leader()

    namespaces = args.namespace or []
    asyncio.run(
        kopf.operator(
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
            standalone=True,
            memo=kopf.Memo(operator=op),
        )
    )
    return 0


def _has_pytorchjobs(api: client.ApiClient) -> bool:
    """Whether kubeflow.org/v1 serves pytorchjobs (then kopf watches them; else the
    pytorchjob backend reads its PyTorchJob with one GET per reconcile)."""
    try:
        resources = client.CustomObjectsApi(api).get_api_resources("kubeflow.org", "v1")
    except client.exceptions.ApiException:
        return False
    return any(r.name == "pytorchjobs" for r in resources.resources)


class _Alive(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"standby\n")

    def log_message(self, *args: Any) -> None:
        pass


class _standby_liveness:  # noqa: N801 - used as a context manager
    """/healthz while waiting for the Lease: a standby is alive, only not leading."""

    def __init__(self, port: int) -> None:
        self.server = http.server.ThreadingHTTPServer(("0.0.0.0", port), _Alive)

    def __enter__(self) -> None:
        threading.Thread(target=self.server.serve_forever, name="standby", daemon=True).start()

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    sys.exit(main())
