"""Cluster DNS for pods, as hosts files: the local stand-in for CoreDNS.

A real cluster resolves ``<hostname>.<subdomain>.<namespace>.svc.cluster.local`` for a pod
that sets ``hostname`` and ``subdomain`` when a headless Service named ``<subdomain>``
selects it; that is how training ranks find each other (MASTER_ADDR). Here every pod's
processes run in their own mount namespace with ``/etc/hosts`` bind-mounted from
``<dns dir>/<pod uid>.hosts``, which this publisher keeps current (the pod's own line,
as the kubelet writes it, then every name published in its namespace). Code under test just
resolves names; nothing in it knows about this.

The publisher runs as its own process with its own identity (``ctj:dns``, RBAC: list/watch
pods and services), because a node may only watch its own pods. Files are rewritten in
place (never renamed): a bind mount pins the inode, so a rename would go unseen.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

Obj = Mapping[str, Any]
CLUSTER_DOMAIN = "cluster.local"
HEADER = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def _selects(service: Obj, pod: Obj) -> bool:
    selector = (service.get("spec") or {}).get("selector") or {}
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _published(pod: Obj) -> bool:
    status = pod.get("status") or {}
    return (
        bool(status.get("podIP"))
        and status.get("phase") in ("Pending", "Running")
        and not pod["metadata"].get("deletionTimestamp")
    )


def hosts_entries(pods: Iterable[Obj], services: Iterable[Obj]) -> dict[str, list[str]]:
    """namespace -> hosts-file lines "<podIP>\\t<fqdn> <short names>", sorted.

    A pod gets a name when it has hostname and subdomain, a headless Service named after
    the subdomain exists in its namespace and selects it, and it has an IP and is not
    terminating (as if publishNotReadyAddresses were true: ranks must find the master
    before it reports Ready). A headless Service's own name resolves, as CoreDNS's A
    records do, to the pods it selects that are Ready (all of them with
    publishNotReadyAddresses): the Kubeflow controller's MASTER_ADDR is such a name."""
    headless = {
        (s["metadata"]["namespace"], s["metadata"]["name"]): s
        for s in services
        if (s.get("spec") or {}).get("clusterIP") == "None"
    }
    lines: dict[str, list[str]] = {}
    for pod in pods:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        ns, hostname, subdomain = meta["namespace"], spec.get("hostname"), spec.get("subdomain")
        if not (hostname and subdomain and _published(pod)):
            continue
        service = headless.get((ns, subdomain))
        if service is None or not _selects(service, pod):
            continue
        lines.setdefault(ns, []).append(_line(pod, f"{hostname}.{subdomain}", ns))
    for (ns, name), service in headless.items():
        public = (service.get("spec") or {}).get("publishNotReadyAddresses")
        for pod in pods:
            if (
                pod["metadata"]["namespace"] == ns
                and _selects(service, pod)
                and _published(pod)
                and (public or _ready(pod))
            ):
                lines.setdefault(ns, []).append(_line(pod, name, ns))
    return {ns: sorted(entries) for ns, entries in lines.items()}


def _line(pod: Obj, base: str, ns: str) -> str:
    names = [f"{base}.{ns}.svc.{CLUSTER_DOMAIN}", f"{base}.{ns}.svc", f"{base}.{ns}", base]
    return f"{pod['status']['podIP']}\t{' '.join(names)}"


def _ready(pod: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def own_entry(pod: Obj, pod_ip: str) -> str:
    """The pod's own line, as the kubelet writes it: its FQDN (with a subdomain) and its
    hostname, so ``socket.getfqdn()`` and gloo's hostname lookup find the pod IP."""
    meta, spec = pod["metadata"], pod.get("spec") or {}
    hostname = spec.get("hostname") or meta["name"]
    if spec.get("subdomain"):
        fqdn = f"{hostname}.{spec['subdomain']}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}"
        return f"{pod_ip}\t{fqdn} {hostname}"
    return f"{pod_ip}\t{hostname}"


def render(own: str | None, entries: Iterable[str]) -> str:
    """A pod's /etc/hosts: localhost, its own line, then its namespace's published names."""
    lines = ([own] if own else []) + [e for e in entries if e != own]
    return HEADER + "".join(f"{line}\n" for line in lines)


def hosts_path(dns_dir: Path, pod_uid: str) -> Path:
    """Each pod has its own hosts file (its own line differs), kept by the publisher."""
    return dns_dir / f"{pod_uid}.hosts"


def write_in_place(path: Path, content: str) -> bool:
    """Rewrites ``path`` keeping its inode (bind mounts see the change); returns whether
    the content changed. New bytes are written over the old before truncating, so a reader
    never sees an empty file."""
    data = content.encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        old = os.pread(fd, len(data) + 1, 0)
        if old == data:
            return False
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        return True
    finally:
        os.close(fd)


class DnsPublisher:
    """Watches pods and services and keeps ``<dns_dir>/<ns>.hosts`` current."""

    def __init__(self, kubeconfig: Path, dns_dir: Path) -> None:
        from kubernetes import client, config

        from .informer import Informer

        self.dns_dir = dns_dir
        dns_dir.mkdir(parents=True, exist_ok=True)
        api = config.new_client_from_config(config_file=str(kubeconfig))
        core = client.CoreV1Api(api)
        self._changed = threading.Event()
        self._known: set[str] = set()
        on_event = lambda _kind, _obj: self._changed.set()  # noqa: E731
        self.pods = Informer(api, core.list_pod_for_all_namespaces, on_event, name="dns-pods")
        self.services = Informer(
            api, core.list_service_for_all_namespaces, on_event, name="dns-services"
        )

    def run_forever(self) -> None:
        self.pods.start()
        self.services.start()
        self.pods.synced.wait()
        self.services.synced.wait()
        while True:
            self._changed.wait()
            self._changed.clear()
            self.publish()

    def publish(self) -> None:
        pods = list(self.pods.store.values())
        entries = hosts_entries(pods, list(self.services.store.values()))
        current: set[str] = set()
        for pod in pods:
            ip = (pod.get("status") or {}).get("podIP")
            if not ip:
                continue
            uid, ns = pod["metadata"]["uid"], pod["metadata"]["namespace"]
            current.add(uid)
            content = render(own_entry(pod, ip), entries.get(ns, []))
            if write_in_place(hosts_path(self.dns_dir, uid), content):
                logging.info(
                    "dns: %s/%s sees %d names",
                    ns,
                    pod["metadata"]["name"],
                    len(entries.get(ns, [])),
                )
        for uid in self._known - current:  # pods gone: their mounts keep the inode
            hosts_path(self.dns_dir, uid).unlink(missing_ok=True)
        self._known = current


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Publish pod DNS names as hosts files.")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--dns-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    DnsPublisher(args.kubeconfig, args.dns_dir).run_forever()


if __name__ == "__main__":
    main()
