"""A simulated node: the kubelet's contract with the control plane, pods as processes.

It registers a Node (capacity: cpu, memory, pods and optional extended resources standing
in for GPUs), keeps its Lease in kube-node-lease renewed and its Ready condition posted,
watches the pods bound to it (fieldSelector spec.nodeName, as a kubelet does: the Node
authorizer allows nothing wider) and runs each one with a PodWorker.

It authenticates as ``system:node:<name>``, so the Node authorizer and NodeRestriction
limit it exactly as they limit a kubelet. One agent is one process; the launcher kills it
to simulate losing the machine: its containers die with it (PR_SET_PDEATHSIG), its Lease
stops, and the node lifecycle controller does the rest.

Run as ``python -m ctj_devcluster.node_agent CONFIG.json`` (see NodeAgentConfig).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from . import dns, volumes
from .informer import Informer
from .kubelet_server import KubeletServer
from .node_config import NodeAgentConfig
from .pod_api import PodApi, now_rfc3339
from .pod_worker import PodWorker
from .podspec import Obj

log = logging.getLogger("ctj_devcluster.node_agent")
LEASE_NAMESPACE = "kube-node-lease"


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NodeAgent:
    def __init__(self, config_: NodeAgentConfig) -> None:
        self.config = config_
        self.subnet = f"{config_.net}.{config_.index}."
        self.node_ip = f"{self.subnet}1"
        self.api = config.new_client_from_config(config_file=str(config_.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        self.pod_api = PodApi(self.api, config_.name)
        self.workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()
        self._free_ips = [f"{self.subnet}{n}" for n in range(254, 1, -1)]
        self._stopping = threading.Event()
        self.node_uid = ""
        self.kubelet_port = config_.kubelet_port
        """The kubelet API's actual port, once it listens (posted in daemonEndpoints)."""
        self._ready_since = now_rfc3339()
        capacity = {
            "cpu": config_.cpu,
            "memory": config_.memory,
            "pods": str(config_.max_pods),
            **config_.extended_resources,
        }
        self.allocatable = dict(capacity)
        self.capacity = capacity

    # --- node registration, heartbeats -------------------------------------------------
    def register(self) -> None:
        labels = {
            "kubernetes.io/hostname": self.config.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **self.config.labels,
        }
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.config.name, "labels": labels},
        }
        try:
            node = self.core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            node = self.core.read_node(self.config.name)
        self.node_uid = node.metadata.uid
        self.post_status()
        self.renew_lease()

    def _register_when_possible(self, timeout: float = 120.0) -> None:
        """Registers, retrying while the API server is still starting (the launcher starts
        agents together with it) or briefly away, like a kubelet."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.register()
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise
                log.info("registration not possible yet (%s); retrying", type(exc).__name__)
                time.sleep(0.2)

    def post_status(self) -> None:
        t, since = now_rfc3339(), self._ready_since
        conditions = [
            {
                "type": kind,
                "status": "False",
                "reason": f"KubeletHas{reason}",
                "lastHeartbeatTime": t,
                "lastTransitionTime": since,
            }
            for kind, reason in (
                ("MemoryPressure", "SufficientMemory"),
                ("DiskPressure", "NoDiskPressure"),
                ("PIDPressure", "SufficientPID"),
            )
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "ctj node agent is posting ready status",
                "lastHeartbeatTime": t,
                "lastTransitionTime": since,
            }
        )
        status = {
            "capacity": self.capacity,
            "allocatable": self.allocatable,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": self.node_ip},
                {"type": "Hostname", "address": self.config.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, self.config.name).hex,
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, self.config.name)),
                "bootID": str(uuid.uuid4()),
                "kernelVersion": platform.release(),
                "osImage": "ctj devcluster node",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "ctj-process://0.1",
                "kubeletVersion": self.config.kubelet_version,
                "kubeProxyVersion": "",
            },
        }
        self.core.patch_node_status(self.config.name, {"status": status})

    def renew_lease(self) -> None:
        name = self.config.name
        try:
            self.coordination.patch_namespaced_lease(
                name, LEASE_NAMESPACE, {"spec": {"renewTime": _micro_now(), "holderIdentity": name}}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease(
                LEASE_NAMESPACE,
                {
                    "metadata": {
                        "name": name,
                        "namespace": LEASE_NAMESPACE,
                        "ownerReferences": [
                            {"apiVersion": "v1", "kind": "Node", "name": name, "uid": self.node_uid}
                        ],
                    },
                    "spec": {
                        "holderIdentity": name,
                        "leaseDurationSeconds": self.config.lease_duration_seconds,
                        "renewTime": _micro_now(),
                    },
                },
            )

    def heartbeat_forever(self) -> None:
        """Renews the lease and reposts status until stopped. Failures (node deleted, API
        briefly away) are logged and retried, as a kubelet does."""
        next_status = 0.0
        while not self._stopping.is_set():
            try:
                self.renew_lease()
                if time.monotonic() >= next_status:
                    self.post_status()
                    next_status = time.monotonic() + self.config.status_update_interval
            except ApiException as exc:
                log.warning("heartbeat failed: %s %s", exc.status, exc.reason)
            except Exception as exc:
                log.warning("heartbeat failed: %r", exc)
            self._stopping.wait(self.config.lease_renew_interval)

    # --- pods ----------------------------------------------------------------------------
    def on_pod_event(self, kind: str, pod: Obj) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.request_stop(2.0, delete=False)
                return
            if worker is not None:
                worker.update(pod)
                if meta.get("deletionTimestamp"):
                    grace = meta.get("deletionGracePeriodSeconds")
                    worker.request_stop(float(30 if grace is None else grace), delete=True)
                return
            if meta.get("deletionTimestamp"):
                # Not running here (it was, under a previous agent): finish the deletion.
                self.pod_api.delete_pod(pod)
                return
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return  # finished before this agent started: nothing to run
            if not self._free_ips:
                log.error("pod %s/%s: no free pod IP on this node", meta["namespace"], meta["name"])
                return
            ip = (pod.get("status") or {}).get("podIP") or self._free_ips[-1]
            if ip in self._free_ips:
                self._free_ips.remove(ip)
            worker = self.workers[uid] = PodWorker(self, pod, ip)
            worker.start()

    def pod_finished(self, worker: PodWorker) -> None:
        """Called by a worker's thread when it is done: remove the pod if it was being
        deleted, free its IP and clean its volumes."""
        if worker.delete_when_stopped and not self._stopping.is_set():
            self.pod_api.delete_pod(worker.pod)
        volumes.cleanup(worker.dir, worker.shm_dir)
        with self._lock:
            self.workers.pop(worker.pod["metadata"]["uid"], None)
            if worker.pod_ip.startswith(self.subnet):
                self._free_ips.append(worker.pod_ip)

    def container_log(self, namespace: str, pod: str, container: str) -> Any:
        """For the kubelet API: a container's log file and whether it is still running."""
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            meta = w.pod["metadata"]
            if (meta["namespace"], meta["name"]) == (namespace, pod):
                for c in w.init_containers + w.containers:
                    if c.name == container:
                        return w.dir / f"{container}.log", c.running
        for path in (self.config.root / "pods").glob(f"{namespace}_{pod}_*/{container}.log"):
            return path, lambda: False
        return None

    def hosts_file(self, pod: Obj, pod_ip: str) -> Path:
        """The pod's /etc/hosts. Created here with the pod's own line if the DNS publisher
        has not written it yet; the publisher then keeps it current."""
        path = dns.hosts_path(self.config.dns_dir, pod["metadata"]["uid"])
        try:  # O_EXCL: never clobber what the publisher already wrote
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return path
        try:
            os.write(fd, dns.render(dns.own_entry(pod, pod_ip), []).encode())
        finally:
            os.close(fd)
        return path

    # --- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        self.config.root.mkdir(parents=True, exist_ok=True)
        if self.config.serving_cert:
            kubelet_api = KubeletServer(
                (self.node_ip, self.config.kubelet_port),
                cert=Path(self.config.serving_cert),
                key=Path(self.config.serving_key),
                client_ca=Path(self.config.client_ca),
                locate=self.container_log,
            ).start()
            self.kubelet_port = kubelet_api.port  # before registering: the Node posts it
            log.info("kubelet API on %s:%d", self.node_ip, self.kubelet_port)
        self._register_when_possible()
        informer = Informer(
            self.api,
            self.core.list_pod_for_all_namespaces,
            self.on_pod_event,
            name=f"pods-{self.config.name}",
            field_selector=f"spec.nodeName={self.config.name}",
        )
        informer.start()
        log.info("node %s registered (%s); watching its pods", self.config.name, self.node_ip)
        self.heartbeat_forever()
        informer.stop()

    def shutdown(self, *_: Any) -> None:
        """SIGTERM: stop every pod's containers, then exit (the node stays registered and
        goes NotReady, like a machine that was switched off)."""
        self._stopping.set()
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            w.request_stop(2.0, delete=False)
        for w in workers:
            if w.thread is not None:
                w.thread.join(timeout=5)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m ctj_devcluster.node_agent CONFIG.json")
    cfg = NodeAgentConfig.from_json(Path(args[0]).read_text())
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {cfg.name} %(levelname)s %(message)s"
    )
    agent = NodeAgent(cfg)
    signal.signal(signal.SIGTERM, agent.shutdown)
    agent.run()


if __name__ == "__main__":
    main()
