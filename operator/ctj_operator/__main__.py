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
import json
import logging
import os
import secrets
import sys
import threading
from typing import Any

import kopf
from ctj_contract import GROUP, NODE_AGENT_PORT
from ctj_contract.tokens import read_key
from kubernetes import client, config

from . import handlers, heartbeats
from .apply import Api
from .builders import CONTROLLED, DEFAULT_SIDECAR_IMAGE
from .heartbeats import HeartbeatChannel
from .kubelet_leases import KubeletLeaseWatch, WatchConfig
from .leader import ElectionConfig, LeaderElection
from .network_policy import (
    NetworkPolicyParams,
    NetworkPolicyParamsError,
    PeerSelector,
    default_prometheus,
)
from .queue import GROUP as KUEUE_GROUP
from .queue import VERSION as KUEUE_VERSION
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
    """The node tier, where the chart installed its node agents (--node-agent-port)."""
    port = args.node_agent_port
    if port is None and args.node_cache_path:  # the flag of the hostPath cache (before 0.2)
        logging.getLogger("ctj").warning(
            "--node-cache-path / CTJ_NODE_CACHE_PATH is deprecated: the node agent holds the "
            "cache now; taking it as --node-agent-port %d",
            NODE_AGENT_PORT,
        )
        port = NODE_AGENT_PORT
    if port is None:
        return None
    try:
        return NodeCache(int(port), driver=args.node_cache_driver or None)
    except (ValueError, SpecError) as exc:
        parser.error(f"--node-agent-port / --node-cache-driver: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ctj-operator")
    parser.add_argument("--kubeconfig", help="default: in-cluster, then ~/.kube/config")
    parser.add_argument(
        "--namespace",
        action="append",
        help="watch only this namespace; repeat for more (default: CTJ_WATCH_NAMESPACES, "
        "comma-separated, else all). The chart's watchNamespaces gives one flag each, with "
        "Roles in just those namespaces",
    )
    parser.add_argument("--metrics-port", type=int, default=8080)
    parser.add_argument(
        "--sidecar-image",
        default=os.environ.get("CTJ_SIDECAR_IMAGE") or DEFAULT_SIDECAR_IMAGE,
        help="checkpoint sidecar image for jobs that name none (default: CTJ_SIDECAR_IMAGE, "
        f"else {DEFAULT_SIDECAR_IMAGE}: the Dockerfile's sidecar target)",
    )
    parser.add_argument(
        "--node-agent-port",
        default=os.environ.get("CTJ_NODE_AGENT_PORT") or None,
        help="the node tier is installed: its node agents listen on every node's address at "
        "this port (the chart's DaemonSet, 9403); unset: no node cache (CTJ_NODE_AGENT_PORT)",
    )
    parser.add_argument(
        "--node-cache-driver",
        default=os.environ.get("CTJ_NODE_CACHE_DRIVER") or None,
        help="the node agents' CSI driver (the chart's, node-cache.ctj.dev): each trainer "
        "mounts its job's node cache read-only and reads its node's chunks there; unset: "
        "over HTTP from the agent (CTJ_NODE_CACHE_DRIVER)",
    )
    parser.add_argument(
        "--node-cache-path",
        default=os.environ.get("CTJ_NODE_CACHE_PATH") or None,
        help=argparse.SUPPRESS,  # deprecated: the hostPath cache's; means the default port
    )
    parser.add_argument("--node-cache-size", help=argparse.SUPPRESS)  # deprecated, ignored
    parser.add_argument(
        "--job-key-file",
        default=os.environ.get("CTJ_JOB_KEY_FILE") or None,
        help="the cluster key every job's token is derived from (the chart mounts its "
        "Secret here, as for the node agents; default: CTJ_JOB_KEY_FILE). Unset: a random "
        "key for this process only, so running jobs' heartbeats are refused after a restart",
    )
    parser.add_argument(
        "--network-policy",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("CTJ_NETWORK_POLICY", "true").lower() != "false",
        help="give each job a NetworkPolicy letting in only its own pods, the node agents, "
        "the operator and Prometheus (default: on; CTJ_NETWORK_POLICY=false: off)",
    )
    parser.add_argument(
        "--prometheus-peer",
        default=os.environ.get("CTJ_PROMETHEUS_PEER") or None,
        help='who the job NetworkPolicy lets scrape the metrics port, as JSON {"namespace'
        'Selector": {...}, "podSelector": {...}}, or "none" (default: pods labelled '
        "app.kubernetes.io/name=prometheus, in any namespace)",
    )
    parser.add_argument("--watch-timeout", type=float, default=60.0)
    parser.add_argument(
        "--reconcile-interval",
        type=float,
        default=handlers.RECONCILE_S,
        metavar="SECONDS",
        help="how often each job is reconciled (default: %(default)s): a failure waits for "
        "a tick to be judged and another for the next attempt to start; each tick costs "
        "about 1 ms of CPU per job (0.1 to 10)",
    )
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
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # "Timer succeeded" every tick
    if not 0.1 <= args.reconcile_interval <= 10:
        parser.error(f"--reconcile-interval {args.reconcile_interval:g}: use 0.1 to 10 seconds")
    handlers.register_reconcile(args.reconcile_interval)
    api = _api_client(args.kubeconfig)
    for backend, at in CONTROLLED.items():  # else a reconcile reads its object by a GET
        if _serves(api, at.group, at.version, at.plural):
            handlers.register_attempts(backend)
    if _serves(api, KUEUE_GROUP, KUEUE_VERSION, "workloads"):
        handlers.register_kueue()  # jobs with a queue label wait for Kueue's admission
    config = OperatorConfig(
        sidecar_image=args.sidecar_image or DEFAULT_SIDECAR_IMAGE,
        node_cache=_node_cache(parser, args),
        job_key=_job_key(parser, args.job_key_file),
        network_policy=_network_policy(parser, args),
    )
    op = Operator(api=Api.connect(api), config=config)
    marks = op.marks
    op.channel = HeartbeatChannel(
        config.job_key,
        marks.beats,
        trainers=marks.trainers,
        tracked=marks.tracked,
        workers=marks.workers,
    )
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

    channel, tasks = op.channel, []

    @kopf.on.startup()
    async def ask_heartbeats(**_: Any) -> None:
        tasks.append(await heartbeats.start(channel, op.leads))

    @kopf.on.cleanup()
    async def stop_heartbeats(**_: Any) -> None:
        for task in tasks:
            await heartbeats.stop(task)

    if op.leader is not None:
        stop_leader = op.leader.release

        @kopf.on.cleanup()
        def release(**_: Any) -> None:
            stop_leader()

    namespaces = args.namespace or watch_namespaces(os.environ.get("CTJ_WATCH_NAMESPACES", ""))
    # kubelet Leases by a watch of kube-node-lease alone, in either mode (kubelet_leases.py)
    kubelets = KubeletLeaseWatch(
        client.CoordinationV1Api(api),
        op.marks.kubelets,
        WatchConfig(timeout_s=max(1, int(args.watch_timeout))),
    )
    kubelets.start()
    kubelets.listed.wait(timeout=10)  # as kopf's indexes: the first reconcile sees them
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


def _network_policy(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> NetworkPolicyParams | None:
    if not args.network_policy:
        return None
    namespace = args.leader_election_namespace  # the operator's own: POD_NAMESPACE
    prometheus: PeerSelector | None = default_prometheus()
    try:
        if args.prometheus_peer == "none":
            prometheus = None
        elif args.prometheus_peer:
            raw = json.loads(args.prometheus_peer)
            if not isinstance(raw, dict):
                raise NetworkPolicyParamsError("give a JSON object")
            prometheus = PeerSelector(
                namespace_selector=raw.get("namespaceSelector") or {},
                pod_selector=raw.get("podSelector") or {},
            )
        return NetworkPolicyParams(operator_namespace=namespace, prometheus=prometheus)
    except (ValueError, NetworkPolicyParamsError) as exc:
        parser.error(f"--prometheus-peer / --leader-election-namespace: {exc}")


def _job_key(parser: argparse.ArgumentParser, path: str | None) -> bytes:
    if path is None:
        logging.getLogger("ctj.operator").warning(
            "no --job-key-file: jobs' tokens are derived from a random key of this process"
        )
        return secrets.token_bytes(32)
    try:
        return read_key(path)
    except ValueError as exc:
        parser.error(f"--job-key-file: {exc}")


def watch_namespaces(value: str) -> list[str]:
    """CTJ_WATCH_NAMESPACES: "team-a, team-b" -> ["team-a", "team-b"]; "" -> [] (all)."""
    return [ns.strip() for ns in value.split(",") if ns.strip()]


def _serves(api: client.ApiClient, group: str, version: str, plural: str) -> bool:
    """Whether the API server serves ``plural`` in ``group/version`` (read at start-up: a
    controller installed later is seen after the operator's next restart)."""
    try:
        resources = client.CustomObjectsApi(api).get_api_resources(group, version)
    except client.exceptions.ApiException:
        return False
    return any(r.name == plural for r in resources.resources)


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
