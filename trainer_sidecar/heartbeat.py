"""The sidecar's heartbeat: one Lease per pod, through which the job and the operator talk.

The operator creates, before each pod of an attempt, a ``coordination.k8s.io/v1`` Lease
named after the pod, and grants the pod's service account ``get, patch`` on it. Every
``CTJ_HEARTBEAT_PERIOD_S`` (2 s) the sidecar sends one JSON merge patch to it:

    {"spec": {"renewTime": "2026-12-01T12:00:00.123456Z"}}

so a rank that stopped beating is seen dead within the Lease's duration, not after the
node-monitor grace. The pod that holds global rank 0 (``NODE_RANK=0``) adds, whenever it
changed, the last committed checkpoint, so the operator can show it without S3
credentials::

    metadata.annotations["training.ctj.dev/last-checkpoint"] =
        '{"step":120,"time":"2026-12-01T12:00:00Z","bytes":1048576}'

From each patch's reply it reads ``metadata.annotations["training.ctj.dev/checkpoint-request"]``
(an opaque id): a new one is written, atomically, to ``<staging root>/checkpoint-request``,
where ``Checkpointer.preemption_requested()`` finds it (save at the step boundary, wait for
the commit, stop: the operator checkpoints a job before a planned resize).

The names and the patch's form are the contract's (``ctj_contract``), which the operator
imports too.

Failures (API server unreachable, 403, 404) are logged as one line, at most every 30 s,
and never stop the persisting. The thread stops, joined, when the sidecar's ``run()``
returns; it imports nothing and never touches torch (the kubernetes client is built on
the caller's thread, and only the sidecar imports it: the library never needs it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ctj_contract import (
    ANNOTATION_CHECKPOINT_REQUEST,
    ANNOTATION_LAST_CHECKPOINT,
    Env,
    LastCheckpoint,
    annotations_of,
    heartbeat_patch,
    rfc3339,
)

from . import __version__
from .errors import CheckpointError
from .metrics import HeartbeatMetrics
from .save.slots import read_request, request_path, write_request

log = logging.getLogger("ctj.heartbeat")

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_PERIOD_S = 2.0
LOG_EVERY_S = 30.0

Patch = Callable[[dict[str, Any]], Mapping[str, Any]]
"""Sends one merge patch to the Lease; returns the patched Lease (its JSON); raises on failure."""


class CommittedCheckpoint(Protocol):
    """What the annotation reports of a manifest."""

    @property
    def step(self) -> int: ...

    @property
    def created(self) -> float: ...

    @property
    def logical_bytes(self) -> int: ...


# -- the pure parts --------------------------------------------------------------------


def last_checkpoint_value(manifest: CommittedCheckpoint) -> str:
    """The last-checkpoint annotation: step, time and logical bytes (the contract's form)."""
    return LastCheckpoint(
        step=int(manifest.step), time=rfc3339(manifest.created), bytes=int(manifest.logical_bytes)
    ).encode()


def describe(exc: BaseException) -> str:
    """One line for a failed call: the API server's status and message, or the error."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status:
        message = ""
        body = getattr(exc, "body", None)
        if isinstance(body, bytes):
            body = body.decode(errors="replace")
        if isinstance(body, str) and body:
            try:
                message = str(json.loads(body).get("message") or "")
            except (ValueError, AttributeError):
                message = body
        reason = getattr(exc, "reason", "") or ""
        text = f"{status} {reason}".strip() + (f": {message}" if message else "")
    else:
        text = f"{type(exc).__name__}: {exc}"
    line = " ".join(text.split())
    return line if len(line) <= 300 else line[:297] + "..."


class RateLimitedLog:
    """A failure that repeats every beat is one log line, then one every ``every_s`` with
    the count in between; the first success after failures says so once."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.every_s = every_s
        self.clock = clock
        self.failing = 0  # failures since the last success
        self._suppressed = 0
        self._last_logged: float | None = None

    def failure(self, why: str) -> bool:
        """Count a failure; True if this one was logged."""
        self.failing += 1
        now = self.clock()
        if self._last_logged is not None and now - self._last_logged < self.every_s:
            self._suppressed += 1
            return False
        more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        self.logger.warning("%s failed: %s%s; still persisting", self.what, why, more)
        self._last_logged = now
        self._suppressed = 0
        return True

    def success(self) -> bool:
        """Note a success; True if it ended a run of failures (and said so)."""
        if not self.failing:
            return False
        self.logger.info("%s works again, after %d failures", self.what, self.failing)
        self.failing = 0
        self._suppressed = 0
        self._last_logged = None
        return True


# -- settings ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatSettings:
    lease: str
    """The Lease to renew (the pod's name)."""
    namespace: str
    period_s: float = DEFAULT_PERIOD_S
    rank0: bool = False
    """This pod holds global rank 0: it reports the last committed checkpoint."""

    def __post_init__(self) -> None:
        if not self.period_s > 0:
            raise CheckpointError(f"heartbeat period is {self.period_s}: use a positive number")

    @property
    def request_timeout_s(self) -> float:
        """One call's limit: a hung API server delays a beat (and the stop) by no more."""
        return max(1.0, min(10.0, 2 * self.period_s))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HeartbeatSettings | None:
        """CTJ_HEARTBEAT_LEASE (unset: no heartbeat), CTJ_POD_NAMESPACE (else the service
        account's namespace), CTJ_HEARTBEAT_PERIOD_S (2.0), NODE_RANK ("0": rank 0)."""
        env = os.environ if env is None else env
        lease = (env.get(Env.HEARTBEAT_LEASE) or "").strip()
        if not lease:
            return None
        namespace = (env.get(Env.POD_NAMESPACE) or "").strip()
        if not namespace:
            try:
                namespace = Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip()
            except OSError:
                pass
        if not namespace:
            raise CheckpointError(
                "CTJ_HEARTBEAT_LEASE is set but CTJ_POD_NAMESPACE is not (and there is no "
                "service account namespace file): set it to the pod's namespace"
            )
        raw = (env.get(Env.HEARTBEAT_PERIOD_S) or "").strip()
        try:
            period = float(raw) if raw else DEFAULT_PERIOD_S
        except ValueError:
            raise CheckpointError(f"CTJ_HEARTBEAT_PERIOD_S={raw!r} is not a number") from None
        rank0 = (env.get(Env.NODE_RANK) or "").strip() == "0"
        return cls(lease=lease, namespace=namespace, period_s=period, rank0=rank0)


# -- the heartbeat ------------------------------------------------------------------------


class Heartbeat:
    """Renews the Lease every period on a thread of its own; see the module docstring.

    ``patch`` does the API call (``kube_patch`` builds the real one), ``latest`` gives the
    last committed manifest (``Persister.latest_committed``), ``root`` is the job's staging
    root. ``beat()`` is one period's work, callable directly (tests).
    """

    def __init__(
        self,
        settings: HeartbeatSettings,
        *,
        patch: Patch,
        latest: Callable[[], CommittedCheckpoint | None],
        root: Path,
        metrics: HeartbeatMetrics | None = None,
        clock: Callable[[], float] = time.time,
        log_every_s: float = LOG_EVERY_S,
        close: Callable[[], None] | None = None,
        on_gone: Callable[[], None] | None = None,
    ) -> None:
        """``on_gone`` runs once when the Lease, renewed before, is not found (404): the
        operator deletes an attempt's Leases only once it has ended the attempt."""
        self.settings = settings
        self._patch = patch
        self._latest = latest
        self.root = Path(root)
        self.metrics = metrics
        self._clock = clock
        self._close = close
        self._on_gone = on_gone
        self.gone = False  # the Lease was renewed, then deleted: the attempt is over
        where = f"{settings.namespace}/{settings.lease}"
        self.where = where
        self._api_log = RateLimitedLog(
            log, f"heartbeat: renewing Lease {where}", every_s=log_every_s
        )
        self._file_log = RateLimitedLog(
            log, f"heartbeat: writing {request_path(self.root)}", every_s=log_every_s
        )
        self.acked: str | None = None  # the last-checkpoint value the Lease carried last reply
        self.request_seen: str | None = read_request(self.root)
        self.beats = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one beat --------------------------------------------------------------------

    def pending_annotation(self) -> str | None:
        """The last-checkpoint value to send with this beat: rank 0's, when the Lease does
        not carry it yet (never sent, changed, or lost with a recreated Lease)."""
        if not self.settings.rank0:
            return None
        latest = self._latest()
        if latest is None:
            return None
        value = last_checkpoint_value(latest)
        return None if value == self.acked else value

    def body(self) -> dict[str, Any]:
        return heartbeat_patch(self._clock(), self.pending_annotation())

    def beat(self) -> bool:
        """Send one patch and act on the reply; False (logged, counted) if it failed."""
        body = self.body()
        self.beats += 1
        try:
            lease = self._patch(body)
        except Exception as exc:  # noqa: BLE001 - any failure: one line, and beat on
            self.failures += 1
            if self.metrics is not None:
                self.metrics.failures.inc()
            self._api_log.failure(describe(exc))
            if getattr(exc, "status", None) == 404 and self.beats > self.failures:
                self._ended()
            return False
        if self.metrics is not None:
            self.metrics.beats.inc()
        self._api_log.success()
        annotations = annotations_of(lease)
        sent = (body.get("metadata") or {}).get("annotations", {}).get(ANNOTATION_LAST_CHECKPOINT)
        self.acked = annotations.get(ANNOTATION_LAST_CHECKPOINT)
        if sent is not None and self.acked == sent:
            log.info("heartbeat: reported the last checkpoint %s", sent)
        self._take_request(annotations.get(ANNOTATION_CHECKPOINT_REQUEST))
        return True

    def _ended(self) -> None:
        if self.gone:
            return
        self.gone = True
        log.info("heartbeat: Lease %s was deleted: the operator ended this attempt", self.where)
        if self._on_gone is not None:
            self._on_gone()

    def _take_request(self, request: str | None) -> None:
        request = (request or "").strip() or None
        if request is None or request == self.request_seen:
            return
        try:
            path = write_request(self.root, request)
        except OSError as exc:
            self._file_log.failure(describe(exc))
            return  # tried again with the next reply
        self._file_log.success()
        self.request_seen = request
        log.info("heartbeat: checkpoint requested (id %r): wrote %s", request, path)

    # -- the thread ----------------------------------------------------------------------

    def start(self) -> None:
        log.info(
            "heartbeat: renewing Lease %s every %.1fs%s",
            self.where,
            self.settings.period_s,
            " and reporting the last checkpoint (rank 0)" if self.settings.rank0 else "",
        )
        self._thread = threading.Thread(target=self._run, name="ctj-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = self.settings.period_s
        due = time.monotonic()
        while not self._stop.is_set():
            self.beat()
            due += period
            now = time.monotonic()
            if due < now:  # a slow call: the next beat is one period from now, not a burst
                due = now + period
            self._stop.wait(due - now)
        if self.pending_annotation() is not None:
            self.beat()  # a commit made while stopping (the SIGTERM grace) still gets reported

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop beating (after a last beat if a commit is still unreported) and join."""
        self._stop.set()
        if self._thread is not None:
            # at most: the call in flight and the last beat, each bounded by the timeout
            self._thread.join(2 * self.settings.request_timeout_s + 5)
            if self._thread.is_alive():
                log.warning("heartbeat: the thread did not stop in time")
        if self._close is not None:
            self._close()
        log.info("heartbeat stopped (%d beats, %d failed)", self.beats, self.failures)


# -- the Kubernetes side -------------------------------------------------------------------


def kube_patch(settings: HeartbeatSettings) -> tuple[Patch, Callable[[], None]]:
    """The real API call, and a close: in-cluster config, else ``KUBECONFIG`` (tests).

    Built on the caller's thread: the import and the config loading happen here, so the
    heartbeat thread imports nothing. Raises CheckpointError when no config is found.
    """
    from kubernetes import client
    from kubernetes import config as kube_config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=configuration)
    except ConfigException as in_cluster:
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise CheckpointError(
                f"no Kubernetes API config: {in_cluster} (and KUBECONFIG is not set)"
            ) from None
        try:
            kube_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        except (ConfigException, OSError) as exc:
            raise CheckpointError(f"cannot load KUBECONFIG={kubeconfig}: {exc}") from None
    configuration.retries = 1  # a dropped keep-alive connection; the next beat is the retry
    api = client.ApiClient(configuration)
    api.user_agent = f"ctj-sidecar/{__version__}"
    timeout = settings.request_timeout_s

    def patch(body: dict[str, Any]) -> Mapping[str, Any]:
        response = api.call_api(
            "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}",
            "PATCH",
            path_params={"namespace": settings.namespace, "name": settings.lease},
            header_params={
                "Accept": "application/json",
                "Content-Type": "application/merge-patch+json",
            },
            body=body,
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _preload_content=False,
            _request_timeout=(timeout, timeout),
        )
        lease: dict[str, Any] = json.loads(response.data)
        return lease

    def close() -> None:
        api.close()
        api.rest_client.pool_manager.clear()

    return patch, close


def start(
    settings: HeartbeatSettings,
    *,
    root: Path,
    latest: Callable[[], CommittedCheckpoint | None],
    metrics: HeartbeatMetrics | None = None,
    on_gone: Callable[[], None] | None = None,
) -> Heartbeat | None:
    """Connect and start beating; None (with the reason logged) if there is no API to use.
    The sidecar persists either way."""
    try:
        patch, close = kube_patch(settings)
    except ImportError as exc:
        log.error("heartbeat disabled: the kubernetes package is missing (%s)", exc)
        return None
    except CheckpointError as exc:
        log.error("heartbeat disabled: %s", exc)
        return None
    beat = Heartbeat(
        settings,
        patch=patch,
        latest=latest,
        root=root,
        metrics=metrics,
        close=close,
        on_gone=on_gone,
    )
    beat.start()
    return beat
