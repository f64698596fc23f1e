"""A plan's actions as API calls (render.py, pure), and the rules apply.py sends them by:
what is already there or already gone is success, a stale status write stops the plan, a
refused attempt is reported. The API server here is a fake that records calls; the real
one answers the same calls in tests/cluster (test_operator_*)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import pytest
from ctj_contract import LABEL_ATTEMPT, LABEL_JOB
from ctj_operator.apply import Api, Outcome, apply
from ctj_operator.decisions import (
    Cause,
    CreateAttempt,
    DeleteAttempt,
    DeleteJob,
    DeletePods,
    Emit,
    PatchStatus,
    Plan,
    Recovered,
    RequestCheckpoint,
    Restarted,
)
from ctj_operator.render import Call, Kind, Target, Verb, render, render_plan
from ctj_operator.spec import JobSpec, NodeCache
from kubernetes.client.exceptions import ApiException

BODY = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1", "resourceVersion": "5"}}
TOKEN = "f" * 64


def target(backend: str = "pods", cache: bool = True) -> Target:
    spec = JobSpec.parse(
        {
            "replicas": 2,
            "backend": backend,
            "checkpoint": {"uri": "s3://b/jobs"},
            "template": {"spec": {"containers": [{"name": "t", "image": "t:1"}]}},
        },
        node_cache=NodeCache() if cache else None,
    )
    return Target(body=BODY, spec=spec, uri="s3://b/jobs/ml/demo-u-1", cache_token=TOKEN)


def shape(calls: tuple[Call, ...]) -> list[tuple[str, str, str]]:
    return [(c.verb.value, c.kind.value, c.name or c.body["metadata"]["name"]) for c in calls]


def test_an_attempt_is_its_secret_then_its_service_and_pods() -> None:
    """No Role, RoleBinding or Lease: pods need no API access (heartbeats are asked)."""
    calls = render(CreateAttempt(3, 2, avoid=("n9",)), target())
    assert shape(calls) == [
        ("create", "Secret", "demo-ctj-cache"),
        ("create", "Service", "demo"),
        ("create", "Pod", "demo-a3-0"),
        ("create", "Pod", "demo-a3-1"),
    ]
    assert calls[0].body["stringData"] == {"token": TOKEN}
    pod = calls[-1].body
    assert pod["metadata"]["labels"][LABEL_ATTEMPT] == "3"
    assert "n9" in json.dumps(pod["spec"]["affinity"]["nodeAffinity"])
    assert {c.namespace for c in calls} == {"ml"}


def test_with_a_policy_the_attempt_makes_the_job_s_networkpolicy_before_any_pod() -> None:
    from dataclasses import replace

    from ctj_operator.network_policy import NetworkPolicyParams

    params = NetworkPolicyParams(operator_namespace="ctj-system")
    calls = render(CreateAttempt(3, 2), replace(target(), network_policy=params))
    assert shape(calls)[:3] == [
        ("create", "Secret", "demo-ctj-cache"),
        ("create", "NetworkPolicy", "demo-ctj"),
        ("create", "Service", "demo"),
    ]
    assert calls[1].body["spec"]["podSelector"] == {"matchLabels": {LABEL_JOB: "demo"}}


def test_a_pytorchjob_attempt_is_its_secret_and_one_pytorchjob_and_no_pods() -> None:
    calls = render(CreateAttempt(2, 3), target("pytorchjob", cache=False))
    assert shape(calls) == [
        ("create", "Secret", "demo-ctj-cache"),
        ("create", "PyTorchJob", "demo-a2"),
    ]


def test_ending_an_attempt_deletes_its_pytorchjob_by_name() -> None:
    assert render(DeleteAttempt(2), target()) == ()
    (job,) = render(DeleteAttempt(2), target("pytorchjob"))
    assert (job.verb, job.kind, job.name) == (Verb.DELETE, Kind.PYTORCHJOB, "demo-a2")
    graceful, forced = (render(DeletePods(("p",), force=f), target())[0] for f in (False, True))
    assert (graceful.grace_seconds, forced.grace_seconds) == (30, 0)


def test_a_checkpoint_request_is_no_api_call() -> None:
    """It rides in the status the plan writes first; the heartbeat channel carries it."""
    for backend in ("pods", "pytorchjob"):
        assert render(RequestCheckpoint(4, 2, "resize-9"), target(backend)) == ()


def test_status_events_and_metrics_only_actions() -> None:
    invalid = Target(body=BODY, spec=None)  # an invalid spec renders only status and Events
    (status,) = render(PatchStatus({"phase": "Failed"}), invalid)
    assert (status.verb, status.body) == (Verb.PATCH_STATUS, {"status": {"phase": "Failed"}})
    (event,) = render(Emit("Warning", "InvalidSpec", "spec.replicas ..."), invalid)
    assert event.body["object"]["metadata"] == {"name": "demo", "namespace": "ml", "uid": "u-1"}
    assert render(Restarted("PodFailed", Cause.CRASH), invalid) == ()
    assert render(Recovered(3.0), invalid) == ()
    with pytest.raises(ValueError, match="no valid spec"):
        render(CreateAttempt(1, 1), invalid)


# ---- apply, against a fake API server ----


def api_error(status: int, message: str = "", reason: str = "") -> ApiException:
    exc = ApiException(status=status, reason=reason or str(status))
    details = {"causes": [{"reason": reason}]} if reason else {}
    exc.body = json.dumps({"message": message, "details": details})
    return exc


class FakeObjects:
    """One kind's objects; ``fail`` maps a verb to the error it raises (once)."""

    def __init__(self, log: list[tuple[str, ...]], kind: str, **fail: ApiException) -> None:
        self.log, self.kind, self.fail, self.existing = log, kind, dict(fail), set[str]()

    def _do(self, verb: str, name: str) -> None:
        self.log.append((verb, self.kind, name))
        if verb in self.fail:
            raise self.fail.pop(verb)

    def create(self, namespace: str, body: Mapping[str, Any]) -> Any:
        self._do("create", body["metadata"]["name"])

    def read(self, namespace: str, name: str) -> Any:
        self._do("read", name)
        if name not in self.existing:
            raise api_error(404)

    def patch(self, namespace: str, name: str, body: Mapping[str, Any]) -> Any:
        self._do("patch", name)

    def patch_status(self, namespace: str, name: str, body: Mapping[str, Any]) -> Any:
        self._do("patch_status", name)
        rv = int(body["metadata"]["resourceVersion"])
        return {"metadata": {"resourceVersion": str(rv + 1)}}

    def delete(self, namespace: str, name: str, grace_seconds: int | None) -> Any:
        self._do("delete", name)

    def delete_if(self, namespace: str, name: str, preconditions: Mapping[str, str]) -> Any:
        self._do("delete_if", f"{name} {json.dumps(preconditions, sort_keys=True)}")


def fake_api(**fail: dict[str, ApiException]) -> tuple[Api, list[tuple[str, ...]]]:
    log: list[tuple[str, ...]] = []
    kinds = {kind: FakeObjects(log, kind.value, **fail.get(kind.name, {})) for kind in Kind}
    return Api(kinds, kinds[Kind.JOB]), log


START = Plan((PatchStatus({"attempt": 1}), CreateAttempt(1, 2), PatchStatus({"podsCreated": True})))


def test_a_plan_is_sent_in_order_each_status_write_on_the_version_before_it() -> None:
    api, log = fake_api(POD={"create": api_error(409)})  # there already: a retried start
    applied: list[str] = []
    outcome = apply(
        render_plan(START, target(cache=False)),
        api,
        resource_version="5",
        on_applied=lambda a: applied.append(type(a).__name__),
    )
    assert outcome.resource_version == "7" and not (outcome.stale or outcome.refused)
    assert applied == ["PatchStatus", "CreateAttempt", "PatchStatus"]
    assert log[0] == ("patch_status", "CheckpointedTrainingJob", "demo")
    assert log[-1] == ("patch_status", "CheckpointedTrainingJob", "demo")
    assert ("create", "Pod", "demo-a1-1") in log


def test_a_stale_status_write_sends_nothing_after_it() -> None:
    api, log = fake_api(JOB={"patch_status": api_error(409)})
    outcome = apply(render_plan(START, target()), api, resource_version="5")
    assert outcome.stale and outcome.resource_version == "5"
    assert log == [("patch_status", "CheckpointedTrainingJob", "demo")]


def test_a_refused_pod_is_reported_and_a_quota_refusal_of_an_existing_one_is_not() -> None:
    api, log = fake_api(POD={"create": api_error(422, "spec.containers[0].image: Required")})
    outcome = apply(render_plan(START, target()), api, resource_version="5")
    assert outcome.refused == "spec.containers[0].image: Required"
    assert ("read", "Pod", "demo-a1-0") in log, "a refusal is settled by reading the pod"
    assert ("patch_status", "CheckpointedTrainingJob", "demo") == log[0] != log[-1]

    api, log = fake_api(POD={"create": api_error(403, "exceeded quota")})
    cast(FakeObjects, api.kinds[Kind.POD]).existing.add("demo-a1-0")
    assert not apply(render_plan(START, target()), api, resource_version="5").refused


RUNTIME_NOT_SEEN = (
    'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: '
    'spec.runtimeRef: Invalid value: {"name":"demo-a1"}: TrainingRuntime.trainer.kubeflow.org '
    '"demo-a1" not found: specified trainingRuntime must be created before the TrainJob'
)


def test_a_trainjob_refused_for_its_runtime_not_yet_seen_is_sent_again() -> None:
    """Trainer's webhook reads runtimes from its informer's cache, which lags the create
    just before (seen on kind): the TrainJob is sent again, not the attempt failed. Any
    other refusal is the attempt's, at once."""
    api, log = fake_api(TRAINJOB={"create": api_error(400, RUNTIME_NOT_SEEN)})
    outcome = apply(render_plan(START, target("trainjob")), api, resource_version="5")
    assert not outcome.refused
    creates = [entry for entry in log if entry[:2] == ("create", "TrainJob")]
    assert creates == [("create", "TrainJob", "demo-a1")] * 2
    assert log.index(("create", "TrainingRuntime", "demo-a1")) < log.index(creates[0])

    api, log = fake_api(TRAINJOB={"create": api_error(422, "spec.trainer: Invalid value")})
    outcome = apply(render_plan(START, target("trainjob")), api, resource_version="5")
    assert outcome.refused == "spec.trainer: Invalid value"
    assert [e for e in log if e[:2] == ("create", "TrainJob")] == [creates[0]]


def test_a_terminating_namespace_ends_the_plan_quietly_and_server_errors_raise() -> None:
    terminating = api_error(403, "namespace ml is terminating", reason="NamespaceTerminating")
    api, _ = fake_api(SECRET={"create": terminating})
    outcome = apply(render_plan(START, target()), api, resource_version="5")
    assert outcome.namespace_terminating and not outcome.refused
    api, _ = fake_api(SECRET={"create": api_error(503)})
    with pytest.raises(ApiException):
        apply(render_plan(START, target()), api, resource_version="5")


def test_what_is_gone_already_is_deleted_and_what_is_there_already_is_made() -> None:
    api, log = fake_api(POD={"delete": api_error(404)}, SECRET={"create": api_error(409)})
    apply(render_plan(Plan((DeletePods(("demo-a1-0",)),)), target()), api, resource_version="5")
    apply(render_plan(Plan((CreateAttempt(2, 1),)), target()), api, resource_version="5")
    assert ("create", "Pod", "demo-a2-0") in log, "the Secret already there: the attempt goes on"
    api, _ = fake_api(POD={"delete": api_error(500)})
    with pytest.raises(ApiException):
        apply(render_plan(Plan((DeletePods(("x",)),)), target()), api, resource_version="5")


def test_a_finished_job_is_deleted_only_if_it_is_still_the_one_read() -> None:
    """Its TTL: the uid and the resourceVersion the plan was made from are preconditions,
    so a job edited since (its TTL raised) or re-created under the name stays."""
    (call,) = render(DeleteJob(0.0), target())
    assert (call.verb, call.kind, call.name) == (Verb.DELETE, Kind.JOB, "demo")
    delete = render_plan(Plan((DeleteJob(0.0),)), target())
    api, log = fake_api()
    assert apply(delete, api, resource_version="5") == Outcome("5")
    assert log == [
        ("delete_if", "CheckpointedTrainingJob", 'demo {"resourceVersion": "5", "uid": "u-1"}')
    ]
    api, _ = fake_api(JOB={"delete_if": api_error(409)})
    assert apply(delete, api, resource_version="5").stale
    api, _ = fake_api(JOB={"delete_if": api_error(404)})  # gone already
    assert apply(delete, api, resource_version="5") == Outcome("5")
    api, _ = fake_api(JOB={"delete_if": api_error(403)})
    with pytest.raises(ApiException):
        apply(delete, api, resource_version="5")


def test_a_carried_pod_gone_before_its_relabel_does_not_stop_the_start() -> None:
    """404 on the relabel: the next reconcile sees the rank missing and ends the attempt."""
    keep = Plan((PatchStatus({"attempt": 2}), CreateAttempt(2, 2, carried=("demo-a1-1",))))
    api, log = fake_api(POD={"patch": api_error(404)})
    outcome = apply(render_plan(keep, target(cache=False)), api, resource_version="5")
    assert not (outcome.stale or outcome.refused)
    assert ("patch", "Pod", "demo-a1-1") in log and ("create", "Pod", "demo-a2-1") in log
