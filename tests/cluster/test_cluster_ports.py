"""Servers the harness starts never lose a port race.

A port chosen by binding port 0 and closing the socket can be taken by anyone before the
server binds it. These tests make that happen on purpose: the chosen port is already
held by a listening socket of ours when the server starts, and the server still comes up
(on another port, after a logged retry), or never needed a chosen port at all.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ctj_devcluster import Binaries, Cluster, ClusterConfig, ports
from ctj_devcluster.local_s3 import LocalS3
from ctj_devcluster.ports import BindConflict, ServerStart, retry_on_bind_conflict
from ctj_devcluster.processes import ProcessDied

from .kube import core, pod_manifest, python_container, wait_pod_phase


@pytest.fixture
def occupy() -> Iterator[list[socket.socket]]:
    """Listening sockets on 127.0.0.1 (ports nobody else can bind), closed at the end."""
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def _occupied(held: list[socket.socket]) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    held.append(s)
    return int(s.getsockname()[1])


def _http_server(log: Path | None) -> Callable[[tuple[int, ...]], subprocess.Popen[bytes]]:
    """launch(ports) for `python -m http.server` (a Python server that takes a port)."""

    def launch(chosen: tuple[int, ...]) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(chosen[0])]
        if log is None:
            return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(log, "ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=out)

    return launch


@pytest.mark.parametrize("with_log", [True, False], ids=["log", "no-log"])
def test_python_server_retries_when_its_port_is_taken(
    occupy: list[socket.socket],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    with_log: bool,
) -> None:
    """The chooser's first port is taken before the server binds it: the server exits
    with "Address already in use", and is started again on a port that works. Without a
    log, the port being taken when it exited is what says it was a conflict."""
    taken = _occupied(occupy)
    real = ports.free_port
    calls: list[int] = []

    def chooser() -> int:
        calls.append(taken if not calls else real())
        return calls[-1]

    monkeypatch.setattr(ports, "free_port", chooser)
    log = tmp_path / "server.log" if with_log else None
    proc, (port,) = retry_on_bind_conflict(
        _http_server(log),
        what="http.server",
        log=log,
        timeout=30,
    )
    try:
        assert calls[0] == taken and port != taken and len(calls) == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            assert resp.status == 200
        if log is not None:
            text = log.read_text()
            assert "Address already in use" in text
            assert f"http.server: port(s) {taken} taken by another process" in text
            assert "restarting on new ports (attempt 2 of 5)" in text
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_dies_otherwise_is_not_retried(tmp_path: Path) -> None:
    log = tmp_path / "dies.log"

    def launch(chosen: tuple[int, ...]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-c", "import sys; sys.exit('bad flag')"], stderr=out
            )

    with pytest.raises(ProcessDied, match="bad flag"):
        retry_on_bind_conflict(launch, what="dies", log=log, timeout=30)
    assert "[ctj_devcluster]" not in log.read_text()


def test_gives_up_after_the_attempts(occupy: list[socket.socket], tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with pytest.raises(BindConflict, match="2 times"):
        retry_on_bind_conflict(
            _http_server(log),
            what="http.server",
            log=log,
            attempts=2,
            timeout=30,
            choose_port=lambda: _occupied(occupy),
        )


def test_local_s3_never_asks_for_a_port(
    occupy: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto gets a socket already bound to port 0 by us: a chooser handing out a taken
    port is never even asked."""
    taken = _occupied(occupy)
    monkeypatch.setattr(ports, "free_port", lambda: taken)
    server = LocalS3.start()
    try:
        assert not server.endpoint.endswith(f":{taken}")
        server.create_bucket("ports-test")
    finally:
        server.stop()


@pytest.mark.cluster
def test_control_plane_starts_although_each_component_loses_its_first_ports(
    cluster_binaries: Binaries,
    tmp_path: Path,
    occupy: list[socket.socket],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd (its peer port, then its client port), kube-apiserver, kube-controller-manager
    and kube-scheduler are each first given a port another process already listens on;
    each is restarted on new ports (a line in its log says so) and the cluster comes up.
    The node agent's kubelet API binds port 0 on its node IP and posts what it got: the
    API server reaches it there (kubectl logs)."""
    original_pick = ServerStart._pick
    taken: dict[str, list[int]] = {}

    def rigged(self: ServerStart[Any]) -> tuple[int, ...]:
        chosen = list(original_pick(self))
        # attempt 1 loses its last port, attempt 2 its first (etcd: peer, then client)
        index = {1: len(chosen) - 1, 2: 0}.get(self.attempt)
        if index is not None and (self.attempt == 1 or len(chosen) > 1):
            chosen[index] = _occupied(occupy)
            taken.setdefault(self.what, []).append(chosen[index])
        return tuple(chosen)

    monkeypatch.setattr(ServerStart, "_pick", rigged)
    cluster = Cluster(ClusterConfig(root=tmp_path / "c", nodes=1), cluster_binaries)
    try:
        cluster.start()
        assert sorted(taken) == [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
        ]
        assert len(taken["etcd"]) == 2
        for name, lost in taken.items():
            text = (cluster.control_plane.logs / f"{name}.log").read_text()
            assert "address already in use" in text
            for port in lost:
                assert f"[ctj_devcluster] {name}: port(s) {port} taken" in text
        api_port = int(cluster.control_plane.server.rsplit(":", 1)[1])
        assert api_port not in taken["kube-apiserver"]
        assert len(cluster.control_plane.processes) == 4  # the lost attempts are gone
        cluster.control_plane.check_alive()

        api = core(cluster)
        node = api.read_node("node-1")
        kubelet_port = node.status.daemon_endpoints.kubelet_endpoint.port
        assert kubelet_port not in (0, 10250)
        code = "print('hello from', __import__('socket').gethostname(), flush=True)"
        api.create_namespaced_pod("default", pod_manifest("hello", [python_container("c", code)]))
        wait_pod_phase(api, "default", "hello", {"Succeeded"})
        # kubectl logs: API server -> the agent's kubelet API, at the port the Node posts
        assert cluster.kubectl("logs", "hello").stdout == "hello from hello\n"
    finally:
        cluster.stop()
