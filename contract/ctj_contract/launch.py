"""The in-place restart protocol: the operator assigns, the sidecar relays, the launcher runs.

A rank's trainer container runs ``python -m trainer_sidecar.launcher -- <the template's
command>`` (builders wrap it). The launcher starts the command as the worker, with the
environment the operator gave the pod, and keeps the pod alive between attempts:

- The operator assigns each pod of an attempt its place (``Assignment``: attempt, node
  rank, world size, rendezvous) in its heartbeat ask. A pod kept from the attempt before
  (a survivor of a failure) is relabelled for the new attempt and gets an assignment
  newer than what it runs; its sidecar writes it to ``<staging>/launch/assignment.json``
  (atomically) and the launcher, which polls that file, stops the old worker and starts
  the new one with ``Assignment.environment()`` over its own environment.
- A worker that exits non-zero leaves the pod running: the launcher writes
  ``<staging>/launch/exit.json`` (``WorkerExit``) and waits for the next assignment; the
  sidecar reports the exit in its heartbeat reply, and the operator ends the attempt as
  it would for a failed pod. A worker that exits 0 ends the launcher with 0 (the job is
  done, or a planned stop checkpointed it), so the pod completes as before.

``<staging>`` is the pod's staging volume (``Env.STAGING_DIR``), which both containers
mount. Both files are small JSON objects read with a size limit; what they hold is
validated as if it came off the network. Plain Python: imported by the operator, the
sidecar and the launcher, none of which may import torch for it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

from .env import Env
from .wire import json_object

LAUNCH_DIR = "launch"
"""Under the staging volume: the sidecar writes the assignment here, the launcher its
worker's exit."""
ASSIGNMENT_FILE = "assignment.json"
EXIT_FILE = "exit.json"
MAX_FILE_BYTES = 4096
"""Either file is refused past this size (a full or hostile volume is no DoS)."""
LAUNCHER_MODULE = "trainer_sidecar.launcher"
"""What builders run in the trainer container: ``python -m`` this, ``--``, the command."""
MAX_HOST_CHARS = 253  # a DNS name's length
MAX_MESSAGE_CHARS = 300
"""Of a failed worker's last line, what is kept (a condition quotes it)."""


def launch_dir(staging_dir: str | os.PathLike[str]) -> Path:
    return Path(staging_dir) / LAUNCH_DIR


def _int(found: dict[str, Any], key: str, what: str, *, least: int = 0) -> int:
    value = found.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{what}: {key} is not an integer >= {least}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    """One pod's place in one attempt: what a PyTorchJob's environment says, per attempt.

    ``world_size`` counts nodes (pods); ``nproc_per_node`` ranks in each (torchrun's
    --nproc-per-node): WORLD_SIZE and RANK are in processes, as a PyTorchJob sets them."""

    attempt: int
    node_rank: int
    world_size: int
    nproc_per_node: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if self.attempt < 0 or self.world_size < 1 or self.nproc_per_node < 1:
            raise ValueError(f"assignment: bad sizes {self}")
        if not 0 <= self.node_rank < self.world_size:
            raise ValueError(
                f"assignment: node rank {self.node_rank} not in [0, {self.world_size})"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"assignment: master port {self.master_port} out of range")
        host = self.master_addr
        if (
            not host
            or len(host) > MAX_HOST_CHARS
            or not all(c.isalnum() or c in ".-:" for c in host)
        ):
            raise ValueError(f"assignment: master address {host[:64]!r} is not a host name")

    def environment(self) -> dict[str, str]:
        """The variables a rank's trainer runs with (the operator's pod environment at
        creation, the launcher's worker environment after an in-place restart): what
        Kubeflow's PyTorchJob sets (MASTER_*, WORLD_SIZE, RANK, PET_* for torchrun) and
        ours (NODE_RANK; CTJ_ATTEMPT, part of every save's identity)."""
        nproc = self.nproc_per_node
        port = str(self.master_port)
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": port,
            "WORLD_SIZE": str(self.world_size * nproc),
            "RANK": str(self.node_rank * nproc),
            Env.NODE_RANK: str(self.node_rank),
            "PET_MASTER_ADDR": self.master_addr,
            "PET_MASTER_PORT": port,
            "PET_NNODES": str(self.world_size),
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(self.node_rank),
            Env.ATTEMPT: str(self.attempt),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "nodeRank": self.node_rank,
            "worldSize": self.world_size,
            "nprocPerNode": self.nproc_per_node,
            "masterAddr": self.master_addr,
            "masterPort": self.master_port,
        }

    @classmethod
    def from_json(cls, found: object) -> Assignment:
        """Raises ValueError for anything malformed."""
        if not isinstance(found, dict):
            raise ValueError("assignment: not a JSON object")
        addr = found.get("masterAddr")
        if not isinstance(addr, str):
            raise ValueError("assignment: masterAddr is not a string")
        return cls(
            attempt=_int(found, "attempt", "assignment"),
            node_rank=_int(found, "nodeRank", "assignment"),
            world_size=_int(found, "worldSize", "assignment", least=1),
            nproc_per_node=_int(found, "nprocPerNode", "assignment", least=1),
            master_addr=addr,
            master_port=_int(found, "masterPort", "assignment", least=1),
        )

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Assignment:
        return cls.from_json(_json(raw, "assignment"))


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerExit:
    """How the worker of ``attempt`` ended while its pod runs on: its exit status, or
    minus the signal that killed it (as ``subprocess`` reports it), and the last line it
    printed (what a failed container's termination message would have quoted)."""

    attempt: int
    code: int
    message: str = ""

    def __post_init__(self) -> None:
        if self.attempt < 0 or not -128 < self.code < 256:
            raise ValueError(f"worker exit: bad values {self}")
        if len(self.message) > MAX_MESSAGE_CHARS:
            object.__setattr__(self, "message", self.message[: MAX_MESSAGE_CHARS - 3] + "...")

    def describe(self) -> str:
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = f"signal {-self.code}"
            what = f"trainer killed by {name}"
        else:
            what = f"trainer exited {self.code}"
        return f"{what}: {self.message}" if self.message else what

    def encode(self) -> bytes:
        found = {"attempt": self.attempt, "code": self.code, "message": self.message}
        return json.dumps(found).encode()

    @classmethod
    def decode(cls, raw: bytes) -> WorkerExit:
        found = _json(raw, "worker exit")
        code = found.get("code")
        if not isinstance(code, int) or isinstance(code, bool):
            raise ValueError("worker exit: code is not an integer")
        message = found.get("message", "")
        if not isinstance(message, str):
            raise ValueError("worker exit: message is not a string")
        return cls(attempt=_int(found, "attempt", "worker exit"), code=code, message=message)


def _json(raw: bytes, what: str) -> dict[str, Any]:
    return json_object(raw, what, MAX_FILE_BYTES)


def read_small(path: Path) -> bytes | None:
    """A protocol file's bytes (at most MAX_FILE_BYTES + 1), or None where there is none.
    Never follows a link nor blocks on a FIFO put in its place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if not _regular(fd):
            raise OSError(f"{path} is not a regular file")
        return os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)


def _regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all (a temporary beside it, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
