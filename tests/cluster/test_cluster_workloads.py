"""Pods run as local processes with what a kubelet gives them: DNS names, env, volumes,
tokens, restarts, exit codes."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from ctj_devcluster import Cluster

from .kube import core, exit_codes, pod_manifest, python_container, wait_pod_phase

pytestmark = pytest.mark.cluster

SERVER = """
import os, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((os.environ["POD_IP"], 9000))   # the pod's own address, as in a pod network
s.listen(1)
conn, peer = s.accept()
data = conn.recv(100).decode()
conn.sendall(b"ack:" + data.encode())
print("got", data, "from", peer[0], flush=True)
raise SystemExit(0 if data == "s3cret" else 9)
"""

CLIENT = """
import os, socket, time
host = "server.peers." + os.environ["NS"] + ".svc.cluster.local"
deadline = time.monotonic() + 60
while True:
    try:
        conn = socket.create_connection((host, 9000), timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
print("self", socket.gethostbyname(socket.gethostname()), flush=True)  # own hosts line
conn.sendall(os.environ["TOKEN"].encode())
print(conn.recv(100).decode(), "from", socket.gethostname(), flush=True)
raise SystemExit(3)
"""


def test_two_pods_talk_by_dns_name_and_report_exit_codes(cluster: Cluster, namespace: str) -> None:
    api = core(cluster)
    api.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "token"}, "data": {"token": base64.b64encode(b"s3cret").decode()}},
    )
    api.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "peers"},
            "spec": {
                "clusterIP": "None",
                "selector": {"app": "pair"},
                "ports": [{"name": "p", "port": 9000}],
            },
        },
    )
    ns_env = {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
    server = pod_manifest(
        "server",
        [
            python_container(
                "main",
                SERVER,
                env=[{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            )
        ],
        hostname="server",
        subdomain="peers",
        labels={"app": "pair"},
    )
    client_pod = pod_manifest(
        "client",
        [
            python_container(
                "main",
                CLIENT,
                env=[
                    ns_env,
                    {
                        "name": "TOKEN",
                        "valueFrom": {"secretKeyRef": {"name": "token", "key": "token"}},
                    },
                ],
            )
        ],
        hostname="client",
        subdomain="peers",
        labels={"app": "pair"},
    )
    api.create_namespaced_pod(namespace, client_pod)  # the client first: it must wait for DNS
    api.create_namespaced_pod(namespace, server)

    done_server = wait_pod_phase(api, namespace, "server", {"Succeeded", "Failed"})
    done_client = wait_pod_phase(api, namespace, "client", {"Succeeded", "Failed"})
    assert exit_codes(done_server) == {"main": 0}, cluster.container_log(
        namespace, "server", "main"
    )
    assert exit_codes(done_client) == {"main": 3}, cluster.container_log(
        namespace, "client", "main"
    )
    assert done_server["status"]["phase"] == "Succeeded"
    assert done_client["status"]["phase"] == "Failed"
    server_ip, client_ip = done_server["status"]["podIP"], done_client["status"]["podIP"]
    assert server_ip.startswith("127.") and client_ip.startswith("127.")
    assert server_ip != client_ip
    # Pods share the host's network namespace: the peer address is 127.0.0.1, not client_ip.
    assert "got s3cret from 127." in cluster.container_log(namespace, "server", "main")
    assert "ack:s3cret from client" in cluster.container_log(namespace, "client", "main")
    assert f"self {client_ip}\n" in cluster.container_log(namespace, "client", "main")
    # kubectl logs goes API server -> the node agent's kubelet API (TLS both ways)
    logs = cluster.kubectl("logs", "client", "-n", namespace).stdout
    assert "ack:s3cret from client" in logs
    assert cluster.kubectl("logs", "server", "-n", namespace, "--tail=1").stdout.startswith(
        "got s3cret"
    )


WRITER = """
import os
open("msg", "w").write(os.environ["MSG"])
"""

READER = """
import json, os, ssl, time, urllib.request
if not os.path.exists("/mnt/ctj-test/shared/attempted"):
    open("/mnt/ctj-test/shared/attempted", "w").close()
    raise SystemExit(1)   # the first run fails: restartPolicy OnFailure runs it again
deadline = time.monotonic() + 30
while not os.path.exists("/mnt/ctj-test/shared/msg") and time.monotonic() < deadline:
    time.sleep(0.1)
print("msg", open("/mnt/ctj-test/shared/msg").read())
sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
ctx = ssl.create_default_context(cafile=sa + "ca.crt")
url = "https://%s:%s/version" % (os.environ["KUBERNETES_SERVICE_HOST"],
                                 os.environ["KUBERNETES_SERVICE_PORT"])
req = urllib.request.Request(url, headers={"Authorization": "Bearer " + open(sa + "token").read()})
print("version", json.load(urllib.request.urlopen(req, context=ctx))["gitVersion"])
print("namespace", open(sa + "namespace").read(), "cwd", os.getcwd())
"""


def test_containers_share_empty_dir_env_and_service_account(
    cluster: Cluster, namespace: str
) -> None:
    api = core(cluster)
    pod = pod_manifest(
        "shared",
        [
            python_container(
                "writer",
                WRITER,
                workingDir="/mnt/ctj-test/w",
                volumeMounts=[{"name": "scratch", "mountPath": "/mnt/ctj-test/w"}],
                env=[
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "MSG", "value": "hello-$(POD_NAME)"},
                ],
            ),
            python_container(
                "reader",
                READER,
                workingDir="/mnt/ctj-test/shared",
                volumeMounts=[{"name": "scratch", "mountPath": "/mnt/ctj-test/shared"}],
            ),
        ],
        restartPolicy="OnFailure",
        volumes=[{"name": "scratch", "emptyDir": {}}],
    )
    api.create_namespaced_pod(namespace, pod)
    done = wait_pod_phase(api, namespace, "shared", {"Succeeded", "Failed"})
    log = cluster.container_log(namespace, "shared", "reader")
    assert done["status"]["phase"] == "Succeeded", log
    assert exit_codes(done) == {"writer": 0, "reader": 0}
    restarts = {s["name"]: s["restartCount"] for s in done["status"]["containerStatuses"]}
    assert restarts == {"writer": 0, "reader": 1}
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector=involvedObject.name=shared"
    ).stdout
    assert "Started" in events and "BackOff" in events, events
    reader = next(s for s in done["status"]["containerStatuses"] if s["name"] == "reader")
    assert reader["lastState"]["terminated"]["exitCode"] == 1
    assert "msg hello-shared" in log
    assert "version v1.34." in log
    assert f"namespace {namespace} cwd /mnt/ctj-test/shared" in log


def test_missing_command_fails_the_pod_with_exit_127(cluster: Cluster, namespace: str) -> None:
    api = core(cluster)
    api.create_namespaced_pod(
        namespace,
        pod_manifest("broken", [{"name": "main", "image": "x", "command": ["no-such-binary-ctj"]}]),
    )
    done = wait_pod_phase(api, namespace, "broken", {"Failed", "Succeeded"})
    assert done["status"]["phase"] == "Failed"
    assert exit_codes(done) == {"main": 127}


def test_init_container_then_native_sidecar_then_main(cluster: Cluster, namespace: str) -> None:
    """The shape of a ctj training pod: init, a sidecar (restartPolicy Always init
    container) running beside the trainer, and the pod done when the trainer is."""
    api = core(cluster)
    mount = [{"name": "staging", "mountPath": "/mnt/ctj-test/staging"}]
    init = python_container(
        "init", "open('/mnt/ctj-test/staging/init', 'w').write('ok')", volumeMounts=mount
    )
    sidecar = python_container(
        "sidecar",
        "import signal\nopen('/mnt/ctj-test/staging/sidecar', 'w').write('up')\nsignal.pause()",
        volumeMounts=mount,
        restartPolicy="Always",
    )
    main = python_container(
        "trainer",
        "import os, time\n"
        "assert open('/mnt/ctj-test/staging/init').read() == 'ok'\n"
        "deadline = time.monotonic() + 30\n"
        "while not os.path.exists('/mnt/ctj-test/staging/sidecar'):\n"
        "    assert time.monotonic() < deadline\n"
        "    time.sleep(0.1)\n"
        "print('trainer saw init and sidecar')\n",
        volumeMounts=mount,
    )
    pod = pod_manifest(
        "trainer",
        [main],
        initContainers=[init, sidecar],
        volumes=[{"name": "staging", "emptyDir": {"medium": "Memory"}}],
    )
    api.create_namespaced_pod(namespace, pod)
    done = wait_pod_phase(api, namespace, "trainer", {"Succeeded", "Failed"})
    assert done["status"]["phase"] == "Succeeded", cluster.container_log(
        namespace, "trainer", "trainer"
    )
    inits = {s["name"]: s["state"] for s in done["status"]["initContainerStatuses"]}
    assert inits["init"]["terminated"]["exitCode"] == 0
    # the sidecar was stopped (SIGTERM) once the trainer finished
    assert inits["sidecar"]["terminated"]["exitCode"] == 128 + 15
    assert "trainer saw init and sidecar" in cluster.container_log(namespace, "trainer", "trainer")


def test_the_first_container_already_sees_its_pod_ip(cluster: Cluster, namespace: str) -> None:
    """status.podIP through the downward API is set from the container's very first start,
    as a kubelet gives it (the sandbox exists first), not once the pod's status has made
    the round trip through the API server. An empty one made a sidecar bind 0.0.0.0 and
    take its port from every later pod on the machine."""
    api = core(cluster)
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
    ]
    code = "import os; print('pod', os.environ['POD_IP'], 'host', os.environ['HOST_IP'])"
    pod = pod_manifest(
        "ips",
        [python_container("main", code, env=env)],
        initContainers=[python_container("first", code, env=env)],
        automountServiceAccountToken=False,  # no volumes: it starts right after the IP is chosen
    )
    api.create_namespaced_pod(namespace, pod)
    done = wait_pod_phase(api, namespace, "ips", {"Succeeded", "Failed"})
    status = done["status"]
    expected = f"pod {status['podIP']} host {status['hostIP']}"
    assert status["podIP"].startswith("127.")
    for container in ("first", "main"):
        assert cluster.container_log(namespace, "ips", container).strip() == expected


def test_a_volume_over_the_images_own_files_hides_only_the_rest(
    cluster: Cluster, namespace: str
) -> None:
    """Here a container's "image" is the host's Python environment and this checkout. The
    sidecar's /tmp emptyDir (restricted: a read-only root) lies over the checkout where the
    checkout is under /tmp, as in a clone made there: the container still imports its own
    code, and sees the volume empty besides."""
    checkout = Path(__file__).resolve().parents[2]
    if checkout.parent == Path("/"):
        pytest.skip("the checkout sits at the root: no directory above it to mount over")
    over = str(checkout.parent)
    code = (
        "import os, sys, ctj_contract\n"
        f"assert ctj_contract.__file__.startswith({str(checkout)!r}), ctj_contract.__file__\n"
        f"open({over!r} + '/mine', 'w').write('x')\n"
        f"print('over', sorted(os.listdir({over!r})))\n"
    )
    pod = pod_manifest(
        "covered",
        [python_container("main", code, volumeMounts=[{"name": "tmp", "mountPath": over}])],
        volumes=[{"name": "tmp", "emptyDir": {}}],
    )
    api = core(cluster)
    api.create_namespaced_pod(namespace, pod)
    done = wait_pod_phase(api, namespace, "covered", {"Succeeded", "Failed"})
    log = cluster.container_log(namespace, "covered", "main")
    assert done["status"]["phase"] == "Succeeded", log
    assert f"over {sorted([checkout.name, 'mine'])}" in log
    assert not (checkout.parent / "mine").exists()  # written to the volume, not the host
