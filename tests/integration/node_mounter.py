"""The node agent's CSI endpoint as a kubelet meets it: the real ``agent-mounter`` process
over a directory standing in for the kubelet's, and the kubelet's gRPC calls to it.

Mounting needs root (the process bind-mounts for real); the tests that use this skip
with the reason where the suite does not run as root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from trainer_sidecar.agent import protowire as pw
from trainer_sidecar.agent.csi import LinuxMounts

OWNER = (12345, 12345)
"""The agent's uid and gid the mounter hands new directories to (any non-root pair)."""


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("bind-mounting a job's cache needs root (the mounter runs as root)")


@contextlib.contextmanager
def short_tmp() -> Iterator[Path]:
    """A directory under /tmp with a short path: a unix socket's path has at most 107
    bytes, and pytest's tmp_path with the kubelet's layout below it runs past them. Any
    mount a failed test left under it is unmounted before it goes."""
    path = Path(tempfile.mkdtemp(prefix="ctj-k-", dir="/tmp"))
    try:
        yield path
    finally:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            point = line.split()[1]
            if point.startswith(f"{path}/"):
                LinuxMounts().unmount(Path(point))
        shutil.rmtree(path, ignore_errors=True)


class Mounter:
    """``python -m trainer_sidecar agent-mounter`` and a kubelet's calls to it."""

    def __init__(self, root: Path, kubelet_dir: Path, node_id: str = "node-0") -> None:
        self.root, self.kubelet_dir, self.node_id = root, kubelet_dir, node_id
        self.log_path = kubelet_dir.with_suffix(".mounter.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer_sidecar", "agent-mounter", "--root", str(root),
             "--kubelet-dir", str(kubelet_dir), "--node-id", node_id,
             "--owner", f"{OWNER[0]}:{OWNER[1]}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.registration = kubelet_dir / "plugins_registry" / "node-cache.ctj.dev-reg.sock"
        deadline = time.monotonic() + 30
        while not self.registration.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the mounter did not start: {self.log_path.read_text()}")
            time.sleep(0.05)
        self.csi = Path(pw.string(self.call(self.registration, "pluginregistration.Registration",
                                            "GetInfo"), 3))  # fmt: skip

    def call(self, socket: Path, service: str, method: str, body: bytes = b"") -> pw.Fields:
        """One unary call, as the kubelet makes it; grpc.RpcError for a refusal."""
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub: Any = channel.unary_unary(
                f"/{service}/{method}",
                request_serializer=lambda b: b,
                response_deserializer=pw.decode,
            )
            return stub(body, timeout=10)  # type: ignore[no-any-return]

    def publish(
        self, namespace: str, job: str, uid: str, *, context: dict[str, str] | None = None,
        target: Path | None = None,
    ) -> Path:  # fmt: skip
        """A pod of ``namespace`` mounts job/uid's directory (an inline volume): its path."""
        if target is None:
            pod = uuid.uuid4()
            target = self.kubelet_dir / f"pods/{pod}/volumes/kubernetes.io~csi/cache/mount"
        volume_context = {
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.namespace": namespace,
            "csi.storage.k8s.io/pod.name": "trainer-0",
            "job": job,
            "uid": uid,
        } | (context or {})
        body = (
            pw.encode_string(1, f"csi-{uuid.uuid4().hex}")
            + pw.encode_string(4, str(target))
            + pw.encode_bool(6, True)
            + pw.encode_map(8, volume_context)
        )
        self.call(self.csi, "csi.v1.Node", "NodePublishVolume", body)
        return target

    def unpublish(self, target: Path) -> None:
        body = pw.encode_string(1, "csi-x") + pw.encode_string(2, str(target))
        self.call(self.csi, "csi.v1.Node", "NodeUnpublishVolume", body)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.log.close()
