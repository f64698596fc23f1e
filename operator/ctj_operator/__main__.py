"""``python -m ctj_operator``: run the operator (in a pod, or against a kubeconfig).

kopf's watch timeouts are set here: a watch the server silently stops feeding
is kopf's best-known failure, so every watch is ended by the server after
``--watch-timeout`` seconds and re-opened, and a client-side timeout backs it up.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

import kopf
from kubernetes import client, config

from . import handlers  # noqa: F401 - registers the handlers
from .handlers import METRICS, Cluster


def _api_client(kubeconfig: str | None) -> client.ApiClient:
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctj-operator")
    parser.add_argument("--kubeconfig", help="default: in-cluster, then ~/.kube/config")
    parser.add_argument(
        "--namespace", action="append", help="watch only these namespaces (default: all)"
    )
    parser.add_argument("--metrics-port", type=int, default=8080)
    parser.add_argument(
        "--sidecar-image",
        default=os.environ.get("CTJ_SIDECAR_IMAGE"),
        help="checkpoint sidecar image for jobs that name none (default: CTJ_SIDECAR_IMAGE)",
    )
    parser.add_argument("--watch-timeout", type=float, default=60.0)
    parser.add_argument("--liveness-port", type=int, default=8081)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    Cluster.connect(_api_client(args.kubeconfig), sidecar_image=args.sidecar_image)

    @kopf.on.startup()
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = int(args.watch_timeout)
        settings.watching.client_timeout = int(args.watch_timeout) + 30
        settings.watching.connect_timeout = 10
        settings.networking.request_timeout = 30
        settings.posting.level = logging.INFO
        settings.persistence.finalizer = f"{handlers.GROUP}/operator"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=handlers.GROUP
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=handlers.GROUP, key="last-handled-configuration"
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

    from prometheus_client import start_http_server

    start_http_server(args.metrics_port, registry=METRICS.registry)
    namespaces = args.namespace or []
    asyncio.run(
        kopf.operator(
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
            standalone=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
