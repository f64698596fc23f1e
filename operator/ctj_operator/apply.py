"""Apply: send a rendered plan's calls in order. The operator's only writes are here.

Every verb is idempotent (an object already there, or already gone, is success), so an
operator killed between two calls converges when it runs the next plan. The job's status
writes, and deleting the job itself (its TTL), are conditional on the resourceVersion the
plan was made from: on a 409 nothing after it is sent (``Outcome.stale``) (the plan's
first action is a status write whenever it creates or deletes; decisions.py). The API's
refusal of an attempt's objects (a 4xx: admission, quota, an invalid pod) is returned,
not raised: the reconcile decides what it costs the job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import kopf
from ctj_contract import GROUP, PLURAL, VERSION
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .builders import CONTROLLED, TRAINING_RUNTIMES
from .decisions import Action, CreateAttempt, CreateSpares
from .queue import GROUP as KUEUE_GROUP
from .queue import VERSION as KUEUE_VERSION
from .queue import WORKLOADS
from .render import ATTEMPT_KINDS, Call, Kind, Rendered, Verb
from .spec import Backend

log = logging.getLogger("ctj.operator")


class _StaleView(Exception):
    """A status write or the job's deletion was refused (409): the plan was made from an
    outdated job."""


class _Objects(Protocol):
    """One kind's namespaced objects, as the calls need them."""

    def create(self, namespace: str, body: Mapping[str, Any]) -> Any: ...
    def read(self, namespace: str, name: str) -> Any: ...
    def patch(self, namespace: str, name: str, body: Mapping[str, Any]) -> Any: ...
    def delete(self, namespace: str, name: str, grace_seconds: int | None) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class _Typed:
    """A built-in kind: the client's ``<verb>_namespaced_<suffix>`` methods."""

    api: Any
    suffix: str

    def _method(self, verb: str) -> Callable[..., Any]:
        return getattr(self.api, f"{verb}_namespaced_{self.suffix}")

    def create(self, namespace: str, body: Mapping[str, Any]) -> Any:
        return self._method("create")(namespace, body)

    def read(self, namespace: str, name: str) -> Any:
        return self._method("read")(name, namespace)

    def patch(self, namespace: str, name: str, body: Mapping[str, Any]) -> Any:
        return self._method("patch")(name, namespace, body)

    def delete(self, namespace: str, name: str, grace_seconds: int | None) -> Any:
        extra = {} if grace_seconds is None else {"grace_period_seconds": grace_seconds}
        return self._method("delete")(name, namespace, **extra)


@dataclasses.dataclass(frozen=True, slots=True)
class _Custom:
    """A custom resource: CustomObjectsApi with its group, version and plural."""

    api: client.CustomObjectsApi
    group: str
    version: str
    plural: str

    def create(self, namespace: str, body: Mapping[str, Any]) -> Any:
        return self.api.create_namespaced_custom_object(
            self.group, self.version, namespace, self.plural, body
        )

    def read(self, namespace: str, name: str) -> Any:
        return self.api.get_namespaced_custom_object(
            self.group, self.version, namespace, self.plural, name
        )

    def patch(self, namespace: str, name: str, body: Mapping[str, Any]) -> Any:
        return self.api.patch_namespaced_custom_object(
            self.group, self.version, namespace, self.plural, name, body
        )

    def patch_status(self, namespace: str, name: str, body: Mapping[str, Any]) -> Any:
        return self.api.patch_namespaced_custom_object_status(
            self.group, self.version, namespace, self.plural, name, body
        )

    def delete_if(self, namespace: str, name: str, preconditions: Mapping[str, str]) -> Any:
        return self.api.delete_namespaced_custom_object(
            self.group,
            self.version,
            namespace,
            self.plural,
            name,
            body={"preconditions": dict(preconditions)},
        )

    def delete(self, namespace: str, name: str, grace_seconds: int | None) -> Any:
        return self.api.delete_namespaced_custom_object(
            self.group, self.version, namespace, self.plural, name
        )


class _Jobs(Protocol):
    """The CheckpointedTrainingJobs themselves: their status, and deleting one (its TTL)."""

    def patch_status(self, namespace: str, name: str, body: Mapping[str, Any]) -> Any: ...
    def delete_if(self, namespace: str, name: str, preconditions: Mapping[str, str]) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Api:
    """Each kind's objects, through the API clients made once at start-up (``connect``)."""

    kinds: Mapping[Kind, _Objects]
    jobs: _Jobs  # the CheckpointedTrainingJobs: their status subresource, deleting one

    @classmethod
    def connect(cls, api_client: client.ApiClient) -> Api:
        core = client.CoreV1Api(api_client)
        custom = client.CustomObjectsApi(api_client)
        rt = TRAINING_RUNTIMES
        jobs = _Custom(custom, GROUP, VERSION, PLURAL)
        kinds: dict[Kind, _Objects] = {
            Kind.POD: _Typed(core, "pod"),
            Kind.SERVICE: _Typed(core, "service"),
            Kind.SECRET: _Typed(core, "secret"),
            Kind.NETWORK_POLICY: _Typed(client.NetworkingV1Api(api_client), "network_policy"),
            **{
                ATTEMPT_KINDS[backend]: _Custom(custom, at.group, at.version, at.plural)
                for backend, at in CONTROLLED.items()
            },
            Kind.TRAINING_RUNTIME: _Custom(custom, rt.group, rt.version, rt.plural),
            Kind.WORKLOAD: _Custom(custom, KUEUE_GROUP, KUEUE_VERSION, WORKLOADS),
            Kind.JOB: jobs,
        }
        return cls(kinds, jobs)

    def read_attempt(self, backend: Backend, namespace: str, name: str) -> dict[str, Any] | None:
        """The PyTorchJob or TrainJob, or None where it does not exist (observe.ReadAttempt)."""
        try:
            return dict(self.kinds[ATTEMPT_KINDS[backend]].read(namespace, name))
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """How far a plan went: every call sent, or up to the one that ended it."""

    resource_version: str
    """The job's, after the last status write sent (the one read if none was)."""
    stale: bool = False
    """A status write found the job changed since it was read: the rest was not sent."""
    refused: str = ""
    """The API's message where it refused an attempt's objects (4xx)."""
    namespace_terminating: bool = False


def apply(
    rendered: Rendered,
    api: Api,
    *,
    resource_version: str,
    on_applied: Callable[[Action], None] = lambda action: None,
) -> Outcome:
    """Send each action's calls in order; ``on_applied`` hears of each action once all
    its calls are sent. An error that is not the objects' fault is raised: kopf runs the
    reconcile again at its next tick."""
    rv = resource_version
    for action, calls in rendered:
        for call in calls:
            try:
                rv = _send(call, api, rv)
            except _StaleView:
                return Outcome(rv, stale=True)
            except ApiException as exc:
                if isinstance(action, CreateSpares) and not _retryable(exc):
                    # a spare over quota or refused by admission: the job runs without it
                    log.warning("a warm spare was refused: %s", _api_message(exc))
                    continue
                if not isinstance(action, CreateAttempt) or _retryable(exc):
                    raise
                if _namespace_terminating(exc):  # the job goes with its namespace
                    return Outcome(rv, namespace_terminating=True)
                return Outcome(rv, refused=_api_message(exc))
        on_applied(action)
    return Outcome(rv)


def _send(call: Call, api: Api, rv: str) -> str:
    """One call, by its verb's rule; returns the job's resourceVersion after it."""
    objects = api.kinds[call.kind]
    ns, name = call.namespace, call.name
    if call.verb == Verb.PATCH_STATUS:
        patch = {**call.body, "metadata": {"resourceVersion": rv}}
        try:
            result = api.jobs.patch_status(ns, name, patch)
        except ApiException as exc:
            if exc.status == 409:
                raise _StaleView from exc
            raise
        return str(result["metadata"]["resourceVersion"])
    if call.verb == Verb.DELETE and call.kind == Kind.JOB:
        preconditions = {**call.body["preconditions"], "resourceVersion": rv}
        try:
            api.jobs.delete_if(ns, name, preconditions)
        except ApiException as exc:
            if exc.status == 409:  # changed since read: the next tick decides again
                raise _StaleView from exc
            if exc.status != 404:
                raise
        return rv
    if call.verb == Verb.STATUS:  # changed since observed, or gone: the next tick sees it
        assert isinstance(objects, _Custom)
        try:
            objects.patch_status(ns, name, call.body)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
        return rv
    if call.verb == Verb.EVENT:
        event = call.body
        kopf.event(
            event["object"], type=event["type"], reason=event["reason"], message=event["message"]
        )
    elif call.verb == Verb.CREATE:
        _create(objects, call)
    elif call.verb == Verb.PATCH:  # a pod gone meanwhile: the decisions see it missing
        _missing_ok(lambda: objects.patch(ns, name, call.body))
    elif call.verb == Verb.DELETE:
        _missing_ok(lambda: objects.delete(ns, name, call.grace_seconds))
    return rv


WEBHOOK_LAG_S = 5.0
"""How long a TrainJob's create is retried while Kubeflow Trainer's webhook says its
TrainingRuntime, created just before it, is not found: the webhook reads runtimes from
its informer's cache, which lags the API server (seen on kind: in 3 of 8 node losses the
next attempt was refused so, and failed as PodRejected, counted a crash)."""
WEBHOOK_RETRY_S = 0.25


def _webhook_lags(call: Call, exc: ApiException) -> bool:
    return (
        call.kind == Kind.TRAINJOB
        and exc.status in (400, 403, 422)
        and "TrainingRuntime" in (message := _api_message(exc))
        and "not found" in message
    )


def _create_past_webhook_lag(objects: _Objects, call: Call) -> None:
    deadline = time.monotonic() + WEBHOOK_LAG_S
    while True:
        try:
            objects.create(call.namespace, call.body)
            return
        except ApiException as exc:
            if not _webhook_lags(call, exc) or time.monotonic() >= deadline:
                raise
        log.info("%s/%s: Trainer's webhook has not seen its TrainingRuntime yet; sending it"
                 " again", call.namespace, call.body["metadata"]["name"])  # fmt: skip
        time.sleep(WEBHOOK_RETRY_S)


def _create(objects: _Objects, call: Call) -> None:
    """Create; already there (409: a retry after a restart) is success. Admission such as
    a ResourceQuota runs before the API server finds the name taken, so re-creating an
    object that exists can be a 403 'exceeded quota' rather than a 409: a refusal is
    settled by reading it. A TrainJob refused for want of the runtime made just before it
    is sent again for up to WEBHOOK_LAG_S."""
    name = call.body["metadata"]["name"]
    try:
        _create_past_webhook_lag(objects, call)
    except ApiException as exc:
        if exc.status == 409:
            return
        if exc.status in (400, 403, 422):
            try:
                objects.read(call.namespace, name)
                return
            except ApiException as read:
                if read.status != 404:
                    raise exc from read
        raise


def _missing_ok(send: Callable[[], Any]) -> None:
    try:
        send()
    except ApiException as exc:
        if exc.status != 404:
            raise


def _retryable(exc: ApiException) -> bool:
    """Not the objects' fault: a conflict, throttling, a server error, no answer."""
    return exc.status in (409, 429) or exc.status is None or exc.status >= 500


def _namespace_terminating(exc: ApiException) -> bool:
    try:
        causes = (json.loads(exc.body or "{}").get("details") or {}).get("causes") or []
    except ValueError:
        return False
    return any(c.get("reason") == "NamespaceTerminating" for c in causes)


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.reason)
