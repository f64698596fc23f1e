"""The node agent's kubelet rules and the DNS publisher's naming, as pure functions
(no cluster needed: these run in every test run)."""

from __future__ import annotations

import base64

import pytest
from ctj_devcluster import dns, podspec

POD = {
    "metadata": {
        "name": "trainer-0",
        "namespace": "ml",
        "uid": "u-1",
        "labels": {"app": "t", "rank": "0"},
    },
    "spec": {
        "nodeName": "node-1",
        "serviceAccountName": "default",
        "hostname": "trainer-0",
        "subdomain": "trainers",
    },
    "status": {"podIP": "127.10.1.2", "hostIP": "127.10.1.1", "phase": "Running"},
}
SECRETS = {("ml", "creds"): {"data": {"key": base64.b64encode(b"AKIA").decode()}}}
MAPS = {("ml", "cfg"): {"data": {"A": "1", "B": "2"}}}


def _env(container: dict) -> dict[str, str]:
    return podspec.container_env(
        POD,
        container,
        base={"PATH": "/venv/bin:/usr/bin"},
        get_secret=lambda ns, n: SECRETS.get((ns, n)),
        get_config_map=lambda ns, n: MAPS.get((ns, n)),
        node_allocatable={"cpu": "4", "memory": "8Gi"},
    )


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("metadata.name", "trainer-0"),
        ("metadata.namespace", "ml"),
        ("metadata.uid", "u-1"),
        ("metadata.labels['rank']", "0"),
        ("spec.nodeName", "node-1"),
        ("status.podIP", "127.10.1.2"),
        ("status.hostIP", "127.10.1.1"),
    ],
)
def test_field_refs(path: str, value: str) -> None:
    assert podspec.field_ref(POD, path) == value


def test_env_resolves_sources_in_order_and_expands_references() -> None:
    env = _env(
        {
            "name": "c",
            "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "X_"}],
            "env": [
                {
                    "name": "RANK",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['rank']"}},
                },
                {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "key"}}},
                {
                    "name": "GONE",
                    "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}},
                },
                {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                {"name": "MSG", "value": "rank=$(RANK) $$(RANK) $(UNSET)"},
            ],
        }
    )
    assert env == {
        "PATH": "/venv/bin:/usr/bin",
        "X_A": "1",
        "X_B": "2",
        "RANK": "0",
        "KEY": "AKIA",
        "CPUS": "4",
        "MSG": "rank=0 $(RANK) $(UNSET)",
    }


def test_missing_secret_is_a_config_error() -> None:
    with pytest.raises(podspec.ConfigError, match="not found"):
        _env(
            {
                "name": "c",
                "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}],
            }
        )


def test_argv_needs_a_command_and_expands_args() -> None:
    assert podspec.container_argv(
        {"name": "c", "command": ["python", "-m", "x"], "args": ["--rank=$(RANK)"]}, {"RANK": "3"}
    ) == ["python", "-m", "x", "--rank=3"]
    with pytest.raises(podspec.ConfigError, match="no command"):
        podspec.container_argv({"name": "c", "args": ["x"]}, {})


@pytest.mark.parametrize(
    ("image", "repository"),
    [
        ("ghcr.io/ctj/operator:0.1.0", "ghcr.io/ctj/operator"),
        ("localhost:5000/trainer", "localhost:5000/trainer"),
        ("python@sha256:abc", "python"),
        ("reg:5000/a/b:1@sha256:abc", "reg:5000/a/b"),
    ],
)
def test_image_repository(image: str, repository: str) -> None:
    assert podspec.image_repository(image) == repository


def test_an_image_entrypoint_stands_in_for_a_missing_command() -> None:
    container = {"name": "op", "image": "ghcr.io/ctj/operator:0.1", "args": ["--ns=$(NS)"]}
    entrypoints = {"ghcr.io/ctj/operator": ["python", "-m", "ctj_operator"]}
    assert podspec.container_argv(container, {"NS": "x"}, entrypoints) == [
        "python",
        "-m",
        "ctj_operator",
        "--ns=x",
    ]


@pytest.mark.parametrize(
    ("policy", "code", "restart"),
    [
        ("Always", 0, True),
        ("Always", 1, True),
        ("OnFailure", 0, False),
        ("OnFailure", 2, True),
        ("Never", 1, False),
    ],
)
def test_restart_policy(policy: str, code: int, restart: bool) -> None:
    assert podspec.should_restart(policy, code) is restart


@pytest.mark.parametrize(
    ("policy", "codes", "phase"),
    [
        ("Never", {"a": 0, "b": None}, "Running"),
        ("Never", {"a": 0, "b": 0}, "Succeeded"),
        ("Never", {"a": 0, "b": 1}, "Failed"),
        ("OnFailure", {"a": 0}, "Succeeded"),
    ],
)
def test_pod_phase(policy: str, codes: dict, phase: str) -> None:
    assert podspec.pod_phase(policy, codes) == phase


def _service(name: str, ns: str = "ml", headless: bool = True) -> dict:
    return {
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": "None" if headless else "10.0.0.5", "selector": {"app": "t"}},
    }


def test_dns_names_pods_of_headless_services_only() -> None:
    other = {
        **POD,
        "metadata": {**POD["metadata"], "name": "x", "labels": {"app": "other"}},
        "spec": {**POD["spec"], "hostname": "x"},
    }
    entries = dns.hosts_entries([POD, other], [_service("trainers")])
    assert entries == {
        "ml": [
            "127.10.1.2\ttrainer-0.trainers.ml.svc.cluster.local trainer-0.trainers.ml.svc "
            "trainer-0.trainers.ml trainer-0.trainers"
        ]
    }
    assert dns.hosts_entries([POD], [_service("trainers", headless=False)]) == {}
    terminating = {**POD, "metadata": {**POD["metadata"], "deletionTimestamp": "now"}}
    assert dns.hosts_entries([terminating], [_service("trainers")]) == {}


def test_a_headless_services_name_resolves_to_the_ready_pods_it_selects() -> None:
    """As CoreDNS answers for the Kubeflow controller's per-replica Services: the Ready
    pods only, unless the Service publishes not-ready addresses."""
    plain = {**POD, "spec": {"nodeName": "node-1"}}  # no hostname/subdomain of its own
    ready = {
        **plain,
        "status": {**POD["status"], "conditions": [{"type": "Ready", "status": "True"}]},
    }
    svc = "kf-a1-master-0"
    line = f"127.10.1.2\t{svc}.ml.svc.cluster.local {svc}.ml.svc {svc}.ml {svc}"
    assert dns.hosts_entries([ready], [_service(svc)]) == {"ml": [line]}
    assert dns.hosts_entries([plain], [_service(svc)]) == {}
    public = _service(svc)
    public["spec"]["publishNotReadyAddresses"] = True
    assert dns.hosts_entries([plain], [public]) == {"ml": [line]}
    assert dns.hosts_entries([ready], [_service(svc, ns="other")]) == {}


def test_a_pod_resolves_its_own_hostname_first() -> None:
    own = dns.own_entry(POD, "127.10.1.2")
    assert own == "127.10.1.2\ttrainer-0.trainers.ml.svc.cluster.local trainer-0"
    plain = {**POD, "spec": {"nodeName": "node-1"}}
    assert dns.own_entry(plain, "127.10.1.9") == "127.10.1.9\ttrainer-0"
    text = dns.render(own, ["127.10.1.3\tb.trainers"])
    assert text == dns.HEADER + own + "\n127.10.1.3\tb.trainers\n"


def test_hosts_file_rewrite_keeps_the_inode(tmp_path) -> None:
    path = tmp_path / "uid.hosts"
    assert dns.write_in_place(path, dns.render(None, ["127.10.1.2\ta.b", "127.10.1.3\tc.b"]))
    inode = path.stat().st_ino
    assert dns.write_in_place(path, dns.render(None, ["127.10.1.2\ta.b"]))
    assert not dns.write_in_place(path, dns.render(None, ["127.10.1.2\ta.b"]))
    assert path.stat().st_ino == inode
    assert path.read_text() == dns.HEADER + "127.10.1.2\ta.b\n"
