"""The node agent's CSI endpoint (trainer_sidecar/agent/csi.py), as a kubelet calls it:
the real ``agent-mounter`` process, gRPC on unix sockets, real read-only bind mounts.

The kubelet's side (registration, a pod's inline volume, its teardown) runs on kind in
tests/e2e/test_node_agent.py; here every answer and refusal is checked one by one.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.integration.node_mounter import OWNER, Mounter, needs_root, short_tmp
from trainer_sidecar.agent import protowire as pw
from trainer_sidecar.agent.csi import mount_points
from trainer_sidecar.agent.store import JobKey, NodeStore
from trainer_sidecar.store.agent_client import AgentCache, job_path

pytestmark = pytest.mark.integration

JOB = JobKey("ml", "demo", "uid-1")
CHUNK = "ab" * 32
DEAD_AGENT = "127.0.0.1:1"  # nothing listens: every byte read below came through the mount


@pytest.fixture
def mounter() -> Iterator[Mounter]:
    needs_root()
    with short_tmp() as tmp:
        (tmp / "cache").mkdir()  # the agent's (the chart's hostPath, DirectoryOrCreate)
        started = Mounter(tmp / "cache", tmp / "kubelet")
        yield started
        started.stop()


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()  # type: ignore[no-any-return]


def test_it_registers_as_a_node_only_csi_plugin(mounter: Mounter) -> None:
    info = mounter.call(mounter.registration, "pluginregistration.Registration", "GetInfo")
    assert pw.string(info, 1) == "CSIPlugin" and pw.string(info, 2) == "node-cache.ctj.dev"
    assert mounter.csi == mounter.kubelet_dir / "plugins/node-cache.ctj.dev/csi.sock"
    assert info[4] == [b"1.0.0"]
    status = pw.encode_bool(1, True)
    mounter.call(mounter.registration, "pluginregistration.Registration",
                 "NotifyRegistrationStatus", status)  # fmt: skip
    identity = mounter.call(mounter.csi, "csi.v1.Identity", "GetPluginInfo")
    assert pw.string(identity, 1) == "node-cache.ctj.dev" and pw.string(identity, 2)
    assert mounter.call(mounter.csi, "csi.v1.Identity", "GetPluginCapabilities") == {}
    assert pw.boolean(pw.message(mounter.call(mounter.csi, "csi.v1.Identity", "Probe"), 1), 1)
    assert pw.string(mounter.call(mounter.csi, "csi.v1.Node", "NodeGetInfo"), 1) == "node-0"
    assert mounter.call(mounter.csi, "csi.v1.Node", "NodeGetCapabilities") == {}


def test_a_pod_reads_its_jobs_chunks_through_a_read_only_mount(mounter: Mounter) -> None:
    store = NodeStore(mounter.root, 1 << 20)
    with store.writing(JOB, CHUNK, 10) as f:
        assert f is not None
        f.write(b"0123456789")
    target = mounter.publish(JOB.namespace, JOB.name, JOB.uid)
    assert str(target) in mount_points()
    cache = AgentCache(DEAD_AGENT, job_path(*JOB.relative.split("/")), token="t" * 32,
                       mount=target)  # fmt: skip
    assert cache.held([CHUNK, "cd" * 32]) == {CHUNK}
    assert cache.read(CHUNK, 2, 7) == b"23456"
    # what the agent writes later shows through the same mount
    with store.writing(JOB, "cd" * 32, 3) as f:
        assert f is not None
        f.write(b"abc")
    assert cache.read("cd" * 32, 0, 3) == b"abc"
    # read-only, no set-uid, no devices, no executables
    flags = os.statvfs(target).f_flag
    assert flags & os.ST_RDONLY and flags & os.ST_NOSUID and flags & os.ST_NODEV
    assert flags & os.ST_NOEXEC
    with pytest.raises(OSError) as refused:
        (target / "planted").write_bytes(b"x")
    assert refused.value.errno == errno.EROFS
    # published again (the kubelet retries): nothing changes; unpublished: gone
    assert mounter.publish(JOB.namespace, JOB.name, JOB.uid, target=target) == target
    mounter.unpublish(target)
    assert str(target) not in mount_points() and not target.exists()
    assert store.held(JOB, [CHUNK]) == [CHUNK]
    mounter.unpublish(target)  # again: nothing to do, no error


def test_a_job_mounted_before_its_first_save_is_made_the_agents(mounter: Mounter) -> None:
    target = mounter.publish("team-b", "fresh", "uid-9")
    made = mounter.root / "team-b" / "fresh" / "uid-9"
    assert [p.name for p in target.iterdir()] == [".created"]  # empty: no chunk yet
    for level in (made.parent.parent, made.parent, made, made / ".created"):
        assert (level.stat().st_uid, level.stat().st_gid) == OWNER, level
    mounter.unpublish(target)


def test_the_namespace_is_the_pods_own_so_no_pod_mounts_another_namespaces_job(
    mounter: Mounter,
) -> None:
    store = NodeStore(mounter.root, 1 << 20)
    with store.writing(JOB, CHUNK, 1) as f:
        assert f is not None
        f.write(b"s")
    # a pod in namespace "intruder" names ml's job: it gets intruder/demo/uid-1, empty
    target = mounter.publish("intruder", JOB.name, JOB.uid)
    assert not (target / CHUNK[:2]).exists()
    assert (mounter.root / "intruder" / JOB.name / JOB.uid).is_dir()
    mounter.unpublish(target)


@pytest.mark.parametrize(
    "context, target, why",
    [
        ({"csi.storage.k8s.io/ephemeral": "false"}, None, "a PersistentVolume"),
        ({"job": "../../etc"}, None, "a path, not a job name"),
        ({"uid": ""}, None, "no uid"),
        ({}, Path("/etc/ctj-planted"), "a target outside the kubelet's pods"),
    ],
)
def test_what_is_refused_as_an_invalid_argument(
    mounter: Mounter, context: dict[str, str], target: Path | None, why: str
) -> None:
    code = _code(lambda: mounter.publish("ml", "demo", "uid-1", context=context, target=target))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, why
    assert not Path("/etc/ctj-planted").exists()
    malformed = _code(lambda: mounter.call(mounter.csi, "csi.v1.Node", "NodePublishVolume",
                                           b"\x0a\xff"))  # fmt: skip
    assert malformed == grpc.StatusCode.INVALID_ARGUMENT
