"""Watch the kubelets' Leases in ``kube-node-lease``, and nowhere else.

A node whose rank went silent is suspect until its kubelet renews its Lease after the mark
(decisions.py); ``Marks.kubelets`` keeps when this process saw each renewal. These Leases
are watched here, not by a kopf index, because kopf watches a namespaced kind in every
namespace it serves: cluster-wide that needs list/watch of every Lease in the cluster (the
control plane's leader elections included), and with ``--namespace`` it would never see
``kube-node-lease`` at all. One namespaced watch needs only a Role in ``kube-node-lease``
(list, watch) in either install mode.

It lists, then watches from the list's resourceVersion with a server-side timeout (a
watch the server silently stops feeding ends by itself), and lists again on 410 Gone or
an error, after a capped backoff. A Lease missing from a relist is forgotten.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from .observe import Freshness

log = logging.getLogger("ctj.operator.kubelets")

NODE_LEASE_NAMESPACE = "kube-node-lease"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WatchConfig:
    namespace: str = NODE_LEASE_NAMESPACE
    timeout_s: int = 60
    """The server ends each watch after this long (as --watch-timeout does for kopf's)."""
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.timeout_s < 1 or not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                "kubelet lease watch: timeout_s must be >= 1 and 0 < backoff_s <= "
                f"max_backoff_s, got {self.timeout_s}, {self.backoff_s:g}, "
                f"{self.max_backoff_s:g}"
            )


class KubeletLeaseWatch:
    """Feeds ``kubelets`` (node name -> renewTime) from one namespace's Leases."""

    def __init__(
        self, coordination: client.CoordinationV1Api, kubelets: Freshness, config: WatchConfig
    ) -> None:
        self.api, self.kubelets, self.config = coordination, kubelets, config
        self._names: set[str] = set()
        self._stop = threading.Event()
        self.listed = threading.Event()
        """Set once the first list has reached ``kubelets``."""

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="ctj-kubelet-leases", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        backoff = self.config.backoff_s
        while not self._stop.is_set():
            try:
                self._watch(self._list())
                backoff = self.config.backoff_s
            except ApiException as exc:
                if exc.status != 410:  # 410: our resourceVersion is too old; list again
                    log.warning("watching kubelet leases: %s %s", exc.status, exc.reason)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, self.config.max_backoff_s)
            except Exception as exc:  # noqa: BLE001 - the API server is unreachable: retry
                log.warning("watching kubelet leases: %s", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.config.max_backoff_s)

    def _list(self) -> str:
        leases = self.api.list_namespaced_lease(
            self.config.namespace, _request_timeout=self.config.timeout_s
        )
        names = set()
        for lease in leases.items:
            names.add(lease.metadata.name)
            self._see(lease.metadata.name, lease.spec)
        for gone in self._names - names:
            self.kubelets.drop(gone)
        self._names = names
        self.listed.set()
        return str(leases.metadata.resource_version)

    def _watch(self, resource_version: str) -> None:
        stream = watch.Watch().stream(
            self.api.list_namespaced_lease,
            self.config.namespace,
            resource_version=resource_version,
            timeout_seconds=self.config.timeout_s,
            _request_timeout=self.config.timeout_s + 30,
        )
        for event in stream:
            if self._stop.is_set():
                return
            kind, obj = event["type"], event["object"]
            if kind == "ERROR":  # e.g. 410 Gone delivered as an event: list again
                return
            name = obj.metadata.name
            if kind == "DELETED":
                self._names.discard(name)
                self.kubelets.drop(name)
            else:
                self._names.add(name)
                self._see(name, obj.spec)

    def _see(self, name: str, spec: Any) -> None:
        """Only a change of renewTime counts: Freshness notes when this process saw it."""
        renew = getattr(spec, "renew_time", None)
        self.kubelets.see(name, None if renew is None else str(renew))
