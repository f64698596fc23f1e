"""The node agent's CSI endpoint: a job's pod mounts its job's directory of the node cache
read-only, as an inline ``csi`` volume (allowed under the ``restricted`` Pod Security
Standard, where a hostPath is not), so a restoring rank reads its own node's chunks with
``pread`` from the page cache instead of over a socket (docs/node-agent.md, "The mount").

What the kubelet asks, over gRPC on unix sockets in its own directory:

- registration (``pluginregistration.Registration`` on
  ``<kubelet>/plugins_registry/<driver>-reg.sock``): what this plugin is and where its
  CSI socket is;
- identity and node services (``csi.v1``, on ``<kubelet>/plugins/<driver>/csi.sock``):
  NodePublishVolume bind-mounts ``<root>/<namespace>/<job>/<uid>`` read-only (nosuid,
  nodev, noexec) onto the pod's target path; NodeUnpublishVolume unmounts it.

Who may mount what: the job and uid come from the volume's attributes, the namespace from
the kubelet (the pod's own, ``podInfoOnMount``), so a pod mounts only a job of its own
namespace, as it could read that job's Secrets. Only inline (ephemeral) volumes are
served. The directory is made if it is not there yet (owned by the agent's user, which
writes it); a pod that mounts it before the job's first save sees it empty.

This runs in a container of its own beside the agent's server (the chart's DaemonSet):
mounting needs root and a privileged container (bidirectional mount propagation into the
kubelet's pod directories); the server that talks to the network needs neither.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import re
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

from ctj_contract import NODE_CACHE_DRIVER, NodeCacheVolume

from ..store.agent_client import job_path
from . import protowire as pw
from .store import CREATED, JobKey, make_job_dir

log = logging.getLogger(__name__)

EPHEMERAL = "csi.storage.k8s.io/ephemeral"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
CSI_VERSIONS = ["1.0.0"]
VENDOR_VERSION = "0.1.0"


class CsiError(Exception):
    """A request the endpoint refuses: ``code`` is the gRPC status's name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class Publish:
    """What a NodePublishVolume asks for, checked."""

    job: JobKey
    target: Path
    pod: str


def publish_request(fields: pw.Fields, kubelet_dir: Path) -> Publish:
    """NodePublishVolumeRequest (csi.proto: volume_id 1, target_path 4, readonly 6,
    volume_context 8) -> what to mount where; CsiError(INVALID_ARGUMENT) naming the fault."""
    if not pw.string(fields, 1):
        raise CsiError("INVALID_ARGUMENT", "volume_id is required")
    context = pw.string_map(fields, 8)
    if context.get(EPHEMERAL) != "true":
        raise CsiError(
            "INVALID_ARGUMENT",
            f"{NODE_CACHE_DRIVER} serves inline (ephemeral) volumes only: use a csi: volume "
            "in the pod, not a PersistentVolume",
        )
    namespace = context.get(POD_NAMESPACE, "")
    name, uid = context.get(NodeCacheVolume.JOB, ""), context.get(NodeCacheVolume.UID, "")
    try:
        job_path(namespace, name, uid)
    except ValueError:
        raise CsiError(
            "INVALID_ARGUMENT",
            f"volumeAttributes {NodeCacheVolume.JOB}={name!r} and {NodeCacheVolume.UID}={uid!r} "
            f"(namespace {namespace!r}) do not name a job: the operator sets them",
        ) from None
    return Publish(JobKey(namespace, name, uid), _target(fields, 4, kubelet_dir),
                   context.get(POD_NAME, "?"))  # fmt: skip


def _target(fields: pw.Fields, number: int, kubelet_dir: Path) -> Path:
    """The target path, which must be a pod's volume directory under the kubelet's."""
    raw = pw.string(fields, number)
    target = Path(os.path.normpath(raw)) if raw else Path()
    pods = kubelet_dir / "pods"
    if not raw or not target.is_absolute() or pods not in target.parents:
        raise CsiError("INVALID_ARGUMENT", f"target_path {raw!r} is not under {pods}")
    return target


class Mounts(Protocol):
    def bind_read_only(self, source: Path, target: Path) -> None: ...
    def unmount(self, target: Path) -> None: ...
    def is_mount(self, target: Path) -> bool: ...


class LinuxMounts:
    """mount(2) and umount2(2) through libc (no mount binary in the image)."""

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
    MNT_DETACH = 2

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _mount(self, source: str, target: Path, flags: int) -> None:
        if self._libc.mount(source.encode(), os.fsencode(target), None, flags, None) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"mount {source} on {target}: {os.strerror(code)}")

    def bind_read_only(self, source: Path, target: Path) -> None:
        self._mount(os.fsdecode(source), target, self.MS_BIND)
        try:  # a bind mount takes its flags only on a remount
            flags = self.MS_BIND | self.MS_REMOUNT | self.MS_RDONLY
            self._mount("none", target, flags | self.MS_NOSUID | self.MS_NODEV | self.MS_NOEXEC)
        except OSError:
            self.unmount(target)
            raise

    def unmount(self, target: Path) -> None:
        if self._libc.umount2(os.fsencode(target), 0) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EBUSY and self._libc.umount2(os.fsencode(target), self.MNT_DETACH) == 0:
            return
        code = ctypes.get_errno()
        raise OSError(code, f"umount {target}: {os.strerror(code)}")

    def is_mount(self, target: Path) -> bool:
        """Whether ``target`` is a mount point: by the mount table, since a bind mount from
        the same filesystem has its parent's device (``os.path.ismount`` misses it)."""
        return os.path.normpath(target) in mount_points()


def mount_points(table: str = "/proc/self/mountinfo") -> set[str]:
    """Every mount point in this mount namespace (mountinfo's fifth field, unescaped)."""
    with open(table, encoding="utf-8", errors="surrogateescape") as f:
        return {_unescape(line.split(" ")[4]) for line in f if line.count(" ") >= 4}


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


@dataclasses.dataclass
class NodeCacheDriver:
    """The CSI plugin's answers; ``root`` is the agent's cache directory, ``owner`` the
    agent's uid and gid (the directories made here are handed to it)."""

    root: Path
    kubelet_dir: Path
    node_id: str
    owner: tuple[int, int]
    mounts: Mounts = dataclasses.field(default_factory=LinuxMounts)
    name: str = NODE_CACHE_DRIVER

    # -- pluginregistration.Registration ---------------------------------------------------

    @property
    def csi_socket(self) -> Path:
        return self.kubelet_dir / "plugins" / self.name / "csi.sock"

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{self.name}-reg.sock"

    def get_info(self, _: pw.Fields) -> bytes:
        return (
            pw.encode_string(1, "CSIPlugin")
            + pw.encode_string(2, self.name)
            + pw.encode_string(3, str(self.csi_socket))
            + pw.encode_strings(4, CSI_VERSIONS)
        )

    def registration_status(self, fields: pw.Fields) -> bytes:
        if pw.boolean(fields, 1):
            log.info("registered with the kubelet as CSI driver %s", self.name)
        else:
            log.error("the kubelet refused CSI driver %s: %s", self.name, pw.string(fields, 2))
        return b""

    # -- csi.v1.Identity -------------------------------------------------------------------

    def plugin_info(self, _: pw.Fields) -> bytes:
        return pw.encode_string(1, self.name) + pw.encode_string(2, VENDOR_VERSION)

    def plugin_capabilities(self, _: pw.Fields) -> bytes:
        return b""  # a node-only plugin: no controller service, no topology

    def probe(self, _: pw.Fields) -> bytes:
        return pw.encode_bytes(1, pw.encode_bool(1, self.root.is_dir()))  # BoolValue ready

    # -- csi.v1.Node -----------------------------------------------------------------------

    def node_info(self, _: pw.Fields) -> bytes:
        return pw.encode_string(1, self.node_id)

    def node_capabilities(self, _: pw.Fields) -> bytes:
        return b""  # no staging, no stats: publish and unpublish only

    def publish(self, fields: pw.Fields) -> bytes:
        request = publish_request(fields, self.kubelet_dir)
        if self.mounts.is_mount(request.target):
            return b""  # published already (the kubelet retries after a timeout)
        source = self._job_dir(request.job)
        request.target.mkdir(parents=True, exist_ok=True)
        try:
            self.mounts.bind_read_only(source, request.target)
        except OSError as exc:
            raise CsiError("INTERNAL", str(exc)) from None
        log.info("mounted %s for pod %s/%s", request.job.relative, request.job.namespace,
                 request.pod)  # fmt: skip
        return b""

    def unpublish(self, fields: pw.Fields) -> bytes:
        if not pw.string(fields, 1):
            raise CsiError("INVALID_ARGUMENT", "volume_id is required")
        target = _target(fields, 2, self.kubelet_dir)
        if self.mounts.is_mount(target):
            try:
                self.mounts.unmount(target)
            except OSError as exc:
                raise CsiError("INTERNAL", str(exc)) from None
        with contextlib.suppress(FileNotFoundError):
            target.rmdir()
        return b""

    def _job_dir(self, job: JobKey) -> Path:
        """The job's directory, made if absent, every level of it the agent's."""
        path = make_job_dir(self.root, job)
        uid, gid = self.owner
        for level in (path.parent.parent, path.parent, path, path / CREATED):
            with contextlib.suppress(FileNotFoundError):
                if level.stat().st_uid != uid:
                    os.chown(level, uid, gid)
        return path

    # -- gRPC --------------------------------------------------------------------------------

    def methods(self) -> dict[str, dict[str, Callable[[pw.Fields], bytes]]]:
        """Service -> method -> handler: what ``serve`` answers on each socket."""
        return {
            "pluginregistration.Registration": {
                "GetInfo": self.get_info,
                "NotifyRegistrationStatus": self.registration_status,
            },
            "csi.v1.Identity": {
                "GetPluginInfo": self.plugin_info,
                "GetPluginCapabilities": self.plugin_capabilities,
                "Probe": self.probe,
            },
            "csi.v1.Node": {
                "NodeGetInfo": self.node_info,
                "NodeGetCapabilities": self.node_capabilities,
                "NodePublishVolume": self.publish,
                "NodeUnpublishVolume": self.unpublish,
            },
        }


def serve(driver: NodeCacheDriver) -> list[Any]:
    """Start the CSI socket's server, then the registration socket's (the kubelet dials the
    former once it sees the latter); the started ``grpc.Server``s."""
    import grpc  # the mounter's only: the rest of the engine does not need it

    def handler(fn: Callable[[pw.Fields], bytes]) -> Any:
        def call(request: bytes, context: Any) -> bytes:
            try:
                return fn(pw.decode(request))
            except CsiError as exc:
                log.warning("refused: %s", exc)
                context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            except pw.WireError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")
            except OSError as exc:
                log.error("failed: %s", exc)
                context.abort(grpc.StatusCode.INTERNAL, str(exc))
            raise AssertionError("unreachable: abort raises")

        # bytes in, bytes out: decoding inside the handler answers a malformed request
        # INVALID_ARGUMENT, where a deserializer's exception would be an INTERNAL error
        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=lambda b: b, response_serializer=lambda b: b
        )

    methods = driver.methods()
    servers = []
    sockets = {
        driver.csi_socket: ("csi.v1.Identity", "csi.v1.Node"),
        driver.registration_socket: ("pluginregistration.Registration",),
    }
    for path, services in sockets.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by the last run
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(
                service, {m: handler(fn) for m, fn in methods[service].items()}
            )
            for service in services
        ])  # fmt: skip
        server.add_insecure_port(f"unix://{path}")
        server.start()
        servers.append(server)
    log.info("CSI driver %s serving %s", driver.name, driver.csi_socket)
    return servers
