"""ctj_devcluster.audit: parsing and counting a recorded kube-apiserver audit log."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from pathlib import Path

import pytest
from ctj_devcluster.audit import AuditEvent, count, read_events

# Recorded from the devcluster's kube-apiserver v1.34.4 with ClusterConfig(audit_log=True):
# a /readyz probe, then requests as ctj-admin with user agent ctj-audit-probe/1.0 (create
# a namespace and a configmap, get it, get a missing one, watch configmaps (the watch's
# ResponseStarted and ResponseComplete), patch, GET /version/, create a service account
# token (a subresource), delete), and the API server's own still-open watch of servicecidrs.
SAMPLE = r"""
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"68d0a370-c7ac-4e97-b785-45b3d1171a2e","stage":"ResponseComplete","requestURI":"/readyz","verb":"get","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"Python-urllib/3.11","responseStatus":{"metadata":{},"code":500},"requestReceivedTimestamp":"2026-12-01T12:29:54.752034Z","stageTimestamp":"2026-12-01T12:29:54.797079Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"21bfebd7-0212-4e69-b3a6-50fb9b221102","stage":"ResponseComplete","requestURI":"/api/v1/namespaces","verb":"create","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"namespaces","name":"probe","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":201},"requestReceivedTimestamp":"2026-12-01T12:29:59.219172Z","stageTimestamp":"2026-12-01T12:29:59.258525Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"3106f9c5-05cc-4c84-8963-fdba1677c29c","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/probe/configmaps","verb":"create","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"configmaps","namespace":"probe","name":"cm","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":201},"requestReceivedTimestamp":"2026-12-01T12:29:59.810257Z","stageTimestamp":"2026-12-01T12:29:59.858127Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"23acb257-a8b9-496e-89b5-828ded993f5d","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/probe/configmaps/cm","verb":"get","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"configmaps","namespace":"probe","name":"cm","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-12-01T12:30:00.003314Z","stageTimestamp":"2026-12-01T12:30:00.073702Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"392c745e-1282-4789-9076-f7712b905c23","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/probe/configmaps/missing","verb":"get","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"configmaps","namespace":"probe","name":"missing","apiVersion":"v1"},"responseStatus":{"metadata":{},"status":"Failure","message":"configmaps \"missing\" not found","reason":"NotFound","details":{"name":"missing","kind":"configmaps"},"code":404},"requestReceivedTimestamp":"2026-12-01T12:30:00.098933Z","stageTimestamp":"2026-12-01T12:30:00.133028Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"060d9591-d2ab-4dfc-b383-73fd412d2ccc","stage":"ResponseStarted","requestURI":"/apis/networking.k8s.io/v1/servicecidrs?allowWatchBookmarks=true\u0026fieldSelector=metadata.name%3Dkubernetes\u0026resourceVersion=1\u0026timeout=6m55s\u0026timeoutSeconds=415\u0026watch=true","verb":"watch","user":{"username":"system:apiserver","uid":"f2ee38fb-4382-456d-b8e7-d962af8061a7","groups":["system:authenticated","system:masters"]},"sourceIPs":["127.0.0.1"],"userAgent":"kube-apiserver/v1.34.4 (linux/amd64) kubernetes/$Format","objectRef":{"resource":"servicecidrs","name":"kubernetes","apiGroup":"networking.k8s.io","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-12-01T12:29:54.930084Z","stageTimestamp":"2026-12-01T12:29:54.931640Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"fd96f3c2-ba37-48ba-93fe-fad8e7276f71","stage":"ResponseStarted","requestURI":"/api/v1/namespaces/probe/configmaps?timeoutSeconds=5\u0026watch=True","verb":"watch","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"configmaps","namespace":"probe","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-12-01T12:30:00.172081Z","stageTimestamp":"2026-12-01T12:30:00.183095Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"fd96f3c2-ba37-48ba-93fe-fad8e7276f71","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/probe/configmaps?timeoutSeconds=5\u0026watch=True","verb":"watch","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"configmaps","namespace":"probe","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-12-01T12:30:00.172081Z","stageTimestamp":"2026-12-01T12:30:00.233021Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"0ae0aa60-c85f-4d99-a5e1-cd3108c47460","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/probe/configmaps/cm","verb":"patch","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"configmaps","namespace":"probe","name":"cm","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-12-01T12:30:00.278071Z","stageTimestamp":"2026-12-01T12:30:00.292633Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"40b8f387-fde5-4d3b-a9d8-bab46acdf3d6","stage":"ResponseComplete","requestURI":"/version/","verb":"get","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-12-01T12:30:00.312968Z","stageTimestamp":"2026-12-01T12:30:00.313577Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"bf385d75-08e5-41f2-81de-9b25518182eb","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/probe/serviceaccounts/default/token","verb":"create","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"serviceaccounts","namespace":"probe","name":"default","apiVersion":"v1","subresource":"token"},"responseStatus":{"metadata":{},"code":201},"requestReceivedTimestamp":"2026-12-01T12:30:00.334350Z","stageTimestamp":"2026-12-01T12:30:00.376741Z","annotations":{"authentication.kubernetes.io/issued-credential-id":"JTI=2d905f28-8a1d-4302-85ed-502b92ea7a03","authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"26ff68a3-51b0-4f7a-8c3e-5874f7dd18f0","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/probe/configmaps/cm","verb":"delete","user":{"username":"ctj-admin","groups":["system:masters","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["X509SHA256=47a603fb635209a06cf17bea21836356b26c80d1b52b565da562335bc53d68a4"]}},"sourceIPs":["127.0.0.1"],"userAgent":"ctj-audit-probe/1.0","objectRef":{"resource":"configmaps","namespace":"probe","name":"cm","apiVersion":"v1"},"responseStatus":{"metadata":{},"status":"Success","details":{"name":"cm","kind":"configmaps","uid":"0f107e87-6d01-4dca-b871-98502e88aebd"},"code":200},"requestReceivedTimestamp":"2026-12-01T12:30:00.397684Z","stageTimestamp":"2026-12-01T12:30:00.426044Z","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""}}
"""  # noqa: E501

ADMIN, AGENT = "ctj-admin", "ctj-audit-probe/1.0"


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "audit.log"
    path.write_text(SAMPLE.lstrip("\n"))
    return path


def test_fields_of_one_event(log: Path) -> None:
    events = read_events(log)
    assert len(events) == 12
    create = next(e for e in events if e.verb == "create" and e.resource == "configmaps")
    assert create == AuditEvent(
        audit_id="3106f9c5-05cc-4c84-8963-fdba1677c29c",
        stage="ResponseComplete",
        verb="create",
        resource="configmaps",
        subresource="",
        api_group="",
        namespace="probe",
        name="cm",
        user=ADMIN,
        groups=("system:masters", "system:authenticated"),
        user_agent=AGENT,
        response_code=201,
        request_uri="/api/v1/namespaces/probe/configmaps",
        request_received=dt.datetime(2026, 12, 1, 12, 29, 59, 810257, tzinfo=dt.UTC),
        stage_timestamp=dt.datetime(2026, 12, 1, 12, 29, 59, 858127, tzinfo=dt.UTC),
    )
    assert create.what == "configmaps"


def test_subresources_groups_and_non_resource_requests(log: Path) -> None:
    events = read_events(log)
    token = next(e for e in events if e.subresource)
    assert (token.resource, token.subresource, token.what) == (
        "serviceaccounts",
        "token",
        "serviceaccounts/token",
    )
    assert (token.namespace, token.name, token.response_code) == ("probe", "default", 201)
    readyz = events[0]
    assert (readyz.verb, readyz.resource, readyz.what, readyz.response_code) == (
        "get",
        "",
        "/readyz",
        500,
    )
    assert readyz.user_agent.startswith("Python-urllib/")
    servicecidrs = next(e for e in events if e.resource == "servicecidrs")
    assert (servicecidrs.api_group, servicecidrs.stage, servicecidrs.verb) == (
        "networking.k8s.io",
        "ResponseStarted",
        "watch",
    )
    assert servicecidrs.path == "/apis/networking.k8s.io/v1/servicecidrs"
    missing = next(e for e in events if e.name == "missing")
    assert missing.response_code == 404


def test_count_one_user_agent_each_request_once(log: Path) -> None:
    events = read_events(log)
    expected = Counter(
        {
            ("create", "namespaces"): 1,
            ("create", "configmaps"): 1,
            ("get", "configmaps"): 2,  # the 200 and the 404
            ("watch", "configmaps"): 1,  # ResponseStarted + ResponseComplete: one watch
            ("patch", "configmaps"): 1,
            ("get", "/version/"): 1,
            ("create", "serviceaccounts/token"): 1,
            ("delete", "configmaps"): 1,
        }
    )
    assert count(events, user=ADMIN, user_agent_prefix="ctj-audit-probe/") == expected
    assert count(events, user_agent_prefix="ctj-audit-probe") == expected
    # ctj-admin also made the /readyz probe, with another user agent
    assert count(events, user=ADMIN) == expected + Counter({("get", "/readyz"): 1})
    assert count(events, user="nobody") == Counter()


def test_an_open_watch_counts_once(log: Path) -> None:
    """The API server's own watch has only its ResponseStarted event: still open."""
    assert count(read_events(log), user="system:apiserver") == Counter(
        {("watch", "servicecidrs"): 1}
    )


def test_count_everything_by_request(log: Path) -> None:
    events = read_events(log)
    assert sum(count(events).values()) == len({e.audit_id for e in events}) == 11


def test_since_until_by_the_time_the_request_was_received(log: Path) -> None:
    events = read_events(log)
    patch = next(e for e in events if e.verb == "patch")
    delete = next(e for e in events if e.verb == "delete")
    assert patch.request_received is not None and delete.request_received is not None
    window = count(events, user=ADMIN, since=patch.request_received, until=delete.request_received)
    assert window == Counter(
        {
            ("patch", "configmaps"): 1,
            ("get", "/version/"): 1,
            ("create", "serviceaccounts/token"): 1,
        }
    )  # since inclusive, until exclusive
    naive = patch.request_received.replace(tzinfo=None)  # naive: taken as UTC
    assert count(events, user=ADMIN, since=naive, until=delete.request_received) == window
    later = delete.request_received + dt.timedelta(microseconds=1)
    assert count(events, since=later) == Counter()


def test_a_line_being_written_is_left_out_a_broken_one_raises(log: Path) -> None:
    complete = read_events(log)
    with open(log, "a") as f:
        f.write('{"kind":"Event","apiVersion":"audit.k8s.io/v1","auditID":"half')
    assert read_events(log) == complete
    with open(log, "a") as f:
        f.write("\n")
    with pytest.raises(ValueError, match=r"audit.log:13: not a JSON audit event"):
        read_events(log)


def test_blank_lines_and_an_empty_log(tmp_path: Path) -> None:
    empty = tmp_path / "audit.log"
    empty.write_text("")
    assert read_events(empty) == []
    assert count([]) == Counter()
