"""Leader election over a coordination.k8s.io Lease, the way client-go's leaderelection does.

Only the holder of the Lease reconciles jobs, so two operator replicas never act on one
job. Timings are client-go's defaults: a leader renews every ``retry_s`` (2 s); if it has
not renewed for ``renew_deadline_s`` (10 s) it stops acting and exits, which is before any
other replica may take the Lease (``lease_s``, 15 s, after the last renewal it saw). A
standby judges expiry by when *it* saw the Lease change, never by the leader's clock.

The holder writes with the resourceVersion it read, so two candidates racing for an
expired Lease cannot both win: the second write is a 409 Conflict.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("ctj.operator.leader")


def micro_time(t: float | None = None) -> str:
    dt = datetime.datetime.fromtimestamp(time.time() if t is None else t, datetime.UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclasses.dataclass(frozen=True, slots=True)
class ElectionConfig:
    namespace: str
    name: str = "ctj-operator"
    identity: str = dataclasses.field(
        default_factory=lambda: f"{os.uname().nodename}-{uuid.uuid4().hex[:8]}"
    )
    lease_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.retry_s < self.renew_deadline_s < self.lease_s:
            raise ValueError(
                "leader election needs retry < renew deadline < lease duration, got "
                f"{self.retry_s:g} / {self.renew_deadline_s:g} / {self.lease_s:g} s"
            )


class LeaderElection:
    def __init__(self, coordination: client.CoordinationV1Api, config: ElectionConfig) -> None:
        self.api, self.config = coordination, config
        self._renewed = -float("inf")  # monotonic time of our last successful write
        self._observed: tuple[Any, float] = (None, time.monotonic())  # (record, seen at)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def is_leader(self) -> bool:
        """True while our last renewal is younger than the renew deadline."""
        return time.monotonic() - self._renewed < self.config.renew_deadline_s

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Blocks until this process holds the Lease (or ``stop`` is set: False)."""
        stop = stop or self._stop
        announced = False
        while not stop.is_set():
            if self._try():
                log.info("became the leader (%s)", self.config.identity)
                return True
            if not announced:
                log.info("standing by: another operator holds lease %s", self.config.name)
                announced = True
            stop.wait(self.config.retry_s)
        return False

    def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew in a thread; ``on_lost`` runs once if a renewal is not made in time."""

        def loop() -> None:
            while not self._stop.wait(self.config.retry_s):
                self._try()
                if not self.is_leader():
                    log.error("lost the leader lease %s: stopping", self.config.name)
                    on_lost()
                    return

        self._thread = threading.Thread(target=loop, name="ctj-leader", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and hand the Lease over at once (a clean shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.retry_s + 5)
        if not self.is_leader():
            return
        try:
            lease = self.api.read_namespaced_lease(self.config.name, self.config.namespace)
            if lease.spec.holder_identity == self.config.identity:
                lease.spec.holder_identity = None
                lease.spec.lease_duration_seconds = 1
                self.api.replace_namespaced_lease(self.config.name, self.config.namespace, lease)
        except ApiException as exc:
            log.warning("could not release the leader lease: %s", exc.reason)
        self._renewed = -float("inf")

    def _try(self) -> bool:
        cfg, now = self.config, time.monotonic()
        spec = client.V1LeaseSpec(
            holder_identity=cfg.identity,
            lease_duration_seconds=round(cfg.lease_s),
            renew_time=micro_time(),
        )
        try:
            lease = self.api.read_namespaced_lease(cfg.name, cfg.namespace)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("reading the leader lease: %s %s", exc.status, exc.reason)
                return False
            spec.acquire_time = spec.renew_time
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=cfg.name), spec=spec)
            return self._write(lambda: self.api.create_namespaced_lease(cfg.namespace, body), now)
        except Exception as exc:  # noqa: BLE001 - the API server is unreachable: retry
            log.warning("reading the leader lease: %s", exc)
            return False
        held = lease.spec or client.V1LeaseSpec()
        record = (held.holder_identity, held.renew_time, lease.metadata.resource_version)
        if record != self._observed[0]:
            self._observed = (record, now)
        ours = held.holder_identity == cfg.identity
        duration = held.lease_duration_seconds or cfg.lease_s
        expired = not held.holder_identity or now - self._observed[1] > duration
        if not (ours or expired):
            return False
        spec.acquire_time = held.acquire_time if ours else spec.renew_time
        spec.lease_transitions = (held.lease_transitions or 0) + (0 if ours else 1)
        lease.spec = spec  # lease.metadata keeps the resourceVersion read: a 409 if it moved
        return self._write(
            lambda: self.api.replace_namespaced_lease(cfg.name, cfg.namespace, lease), now
        )

    def _write(self, call: Callable[[], Any], started: float) -> bool:
        try:
            call()
        except ApiException as exc:
            if exc.status not in (409, 404):
                log.warning("writing the leader lease: %s %s", exc.status, exc.reason)
            return False
        except Exception as exc:  # noqa: BLE001
            log.warning("writing the leader lease: %s", exc)
            return False
        self._renewed = started  # counted from before the request: never overestimated
        return True
