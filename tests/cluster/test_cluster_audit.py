"""ClusterConfig(audit_log=True): the API server logs every request, and
ctj_devcluster.audit counts exactly the ones a client made."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from ctj_devcluster import Binaries, Cluster, ClusterConfig
from ctj_devcluster.audit import count, read_events
from ctj_devcluster.kubeconfig import write_kubeconfig
from ctj_devcluster.processes import wait_until
from kubernetes import client, config, watch

pytestmark = pytest.mark.cluster

USER, AGENT = "ctj:audit-bench", "ctj-audit-bench/1.0"


@pytest.fixture(scope="module")
def audit_cluster(
    cluster_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    c = Cluster(
        ClusterConfig(root=tmp_path_factory.mktemp("auditcluster"), nodes=0, audit_log=True),
        cluster_binaries,
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _client_as(cluster: Cluster, user: str, tmp: Path) -> client.ApiClient:
    ca = cluster.control_plane.ca
    assert ca is not None
    cert = ca.issue("audit-bench", common_name=user, client=True)
    kubeconfig = write_kubeconfig(
        tmp / "bench.kubeconfig",
        server=cluster.control_plane.server,
        ca_cert=ca.pair.cert,
        client=cert,
        user="bench",
    )
    api = config.new_client_from_config(config_file=str(kubeconfig))
    api.user_agent = AGENT
    return api


def test_audit_log_counts_exactly_the_requests_a_user_made(
    audit_cluster: Cluster, tmp_path: Path
) -> None:
    admin = client.CoreV1Api(audit_cluster.api_client())
    ns = "audit"
    admin.create_namespace({"metadata": {"name": ns}})
    rbac = client.RbacAuthorizationV1Api(audit_cluster.api_client())
    rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": "bench"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "bench"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "bench"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
        },
    )
    bench = client.CoreV1Api(_client_as(audit_cluster, USER, tmp_path))
    wait_until(  # RBAC is cached: wait until the binding is seen (these reads count too)
        lambda: bench.list_namespaced_config_map(ns) is not None,
        timeout=30,
        what="the bench user's Role",
    )
    warmup = count(read_events(audit_cluster.audit_log_path), user=USER)
    assert set(warmup) <= {("list", "configmaps")}, warmup
    began = dt.datetime.now(dt.UTC)

    bench.create_namespaced_config_map(ns, {"metadata": {"name": "cm"}, "data": {"a": "1"}})
    bench.read_namespaced_config_map("cm", ns)
    bench.list_namespaced_config_map(ns)
    stream = watch.Watch()
    for _event in stream.stream(bench.list_namespaced_config_map, ns, timeout_seconds=30):
        stream.stop()  # one watch opened, one event read, closed
    bench.patch_namespaced_config_map("cm", ns, {"data": {"a": "2"}})
    bench.delete_namespaced_config_map("cm", ns)
    with pytest.raises(client.ApiException) as forbidden:
        bench.list_namespaced_secret(ns)
    assert forbidden.value.status == 403

    expected = Counter(
        {
            ("create", "configmaps"): 1,
            ("get", "configmaps"): 1,
            ("list", "configmaps"): 1,
            ("watch", "configmaps"): 1,
            ("patch", "configmaps"): 1,
            ("delete", "configmaps"): 1,
            ("list", "secrets"): 1,
        }
    )

    def counted() -> Counter[tuple[str, str]]:
        return count(read_events(audit_cluster.audit_log_path), user=USER, since=began)

    # Written as each request finishes; a closed watch's end may trail the client a bit.
    wait_until(
        lambda: counted() == expected,
        timeout=10,
        what="the audit events",
        on_timeout=lambda: f"counted {counted()}, expected {expected}",
    )
    events = read_events(audit_cluster.audit_log_path)
    assert count(events, user=USER, since=began) == expected
    assert count(events, user_agent_prefix="ctj-audit-bench/", since=began) == expected
    assert count(events, user=USER) == expected + warmup
    assert count(events, user=USER, until=began) == warmup
    mine = [
        e for e in events if e.user == USER and e.request_received and e.request_received >= began
    ]
    codes = {(e.verb, e.what): e.response_code for e in mine if e.stage == "ResponseComplete"}
    assert codes == {
        ("create", "configmaps"): 201,
        ("get", "configmaps"): 200,
        ("list", "configmaps"): 200,
        ("watch", "configmaps"): 200,
        ("patch", "configmaps"): 200,
        ("delete", "configmaps"): 200,
        ("list", "secrets"): 403,
    }
    assert all(e.namespace == ns and e.user_agent == AGENT for e in mine)
    assert {e.stage for e in events} <= {"ResponseStarted", "ResponseComplete"}  # no Received
