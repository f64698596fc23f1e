"""The contract between the operator and the pods it makes: every name that crosses.

The operator writes these names into the objects it creates (labels, annotations,
environment variables); the engine and its sidecar read them back in the pod,
and answer the operator's heartbeat with the last-checkpoint report it reads. Both sides
import this module, so a name is spelled once; tests/unit/test_contract.py builds a pod
with the operator's builders and starts the engine's configuration from its environment.

Plain Python only: the operator imports it without torch, the sidecar without kopf.
"""

from __future__ import annotations

import calendar
import dataclasses
import enum
import json
import math
import time
from collections.abc import Mapping
from typing import Any, TypeGuard

from .env import Env as Env  # re-exported: every CTJ_* name
from .launch import Assignment
from .wire import json_object

# -- the API group and the resource ------------------------------------------------------

GROUP = "training.ctj.dev"
VERSION = "v1alpha1"
PLURAL = "checkpointedtrainingjobs"
KIND = "CheckpointedTrainingJob"


class Phase(enum.StrEnum):
    """``status.phase`` of a job."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Condition(enum.StrEnum):
    """``status.conditions[].type`` of a job (metav1.Condition semantics: each True or False,
    its lastTransitionTime changed only when its status does, its observedGeneration the
    spec's generation it was set from). The phases' conditions say what ``status.phase``
    says, one type each, for ``kubectl wait --for=condition=...`` and health checks."""

    QUEUED = "Queued"
    """Waiting for nodes to start an attempt on (fewer fit than spec.minReplicas)."""
    RUNNING = "Running"
    """An attempt runs."""
    RESTARTING = "Restarting"
    """Between attempts: the last one ended (the reason says why), the next not started."""
    SUCCEEDED = "Succeeded"
    """Every rank exited 0: final."""
    FAILED = "Failed"
    """The job gave up (MaxRestartsExceeded, DeadlineExceeded, InvalidSpec): final."""
    SUSPENDED = "Suspended"
    """spec.suspend holds the job with no pod: its last attempt checkpointed at a step
    boundary and stopped; resuming (spec.suspend false) restores that step."""
    RESTARTED = "Restarted"
    """Why the last attempt ended; True from the first restart on (status.restarts and
    status.nodeRestarts count them)."""
    SPEC_PENDING = "SpecPending"
    """True while the spec was changed after the running attempt started (status.
    attemptGeneration < metadata.generation): the change applies at the next attempt."""


# -- labels ---------------------------------------------------------------------------------

LABEL_JOB = f"{GROUP}/job-name"
"""On every object of a job: the job's name (the operator's watches select on it)."""
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_RANK = f"{GROUP}/node-rank"
LABEL_WORLD = f"{GROUP}/world-size"
LABEL_SPARE = f"{GROUP}/spare"
"""On a warm spare ("true"): a pod of no attempt yet, its launcher idle until an assignment
makes it a rank (the label is removed then). It carries no attempt or rank label."""
ANNOTATION_AVOID = f"{GROUP}/avoid-nodes"
"""On a warm spare made while nodes were suspect: those nodes (comma-separated), which its
node affinity keeps it off. One left Pending after they are trusted again is made anew."""
LABEL_LAUNCHER = f"{GROUP}/launcher"
"""On a pod whose trainer runs under the ctj launcher ("true"): it can be kept across an
unplanned restart, its worker restarted in place (``ctj_contract.launch``)."""


NODE_AGENT_PORT = 9403
"""The node agent's port (a hostPort on every node; its container port is named
``node-cache``)."""


NODE_CACHE_DRIVER = "node-cache.ctj.dev"
"""The node agent's CSI driver (the chart's CSIDriver): an inline ``csi`` volume of this
driver in a job's pod is its job's directory of the node cache, mounted read-only, so a
restoring rank reads its own node's bytes from the page cache, not over a socket."""
NODE_CACHE_MOUNT_PATH = "/var/run/ctj/node-cache"
"""Where the operator mounts that volume in the trainer container (``Env.NODE_CACHE_MOUNT``)."""


class NodeCacheVolume(enum.StrEnum):
    """The volumeAttributes of that volume: which job's directory. The namespace is the
    pod's own (the kubelet passes it), so a pod can mount only its namespace's jobs."""

    JOB = "job"
    UID = "uid"


CACHE_TOKEN_KEY = "token"
"""The key of the job's Secret (``<job>-ctj-cache``) that holds ``Env.CACHE_TOKEN``."""


# -- the heartbeat: the operator asks each rank's sidecar, over HTTP --------------------


def rfc3339(ts: float) -> str:
    """RFC 3339 in UTC to the second (the form the job's status uses)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def parse_time(value: object) -> float | None:
    """What ``rfc3339`` writes, read back; None where absent or not such a time."""
    try:
        return float(calendar.timegm(time.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


HEARTBEAT_PATH = "/v1/heartbeat"
"""On the sidecar's metrics port: the operator POSTs a ``HeartbeatAsk`` every period, with
``Authorization: Bearer <the job's token>``; the sidecar answers a ``HeartbeatReply``. No
API write per beat, no Kubernetes credentials in the pod: a rank that does not answer
within the job's heartbeat timeout is lost."""
HEARTBEAT_MAX_BODY = 4096
"""Bytes either side reads of a heartbeat message, at most (a larger one is refused)."""


def _message(raw: bytes, what: str) -> dict[str, Any]:
    return json_object(raw, what, HEARTBEAT_MAX_BODY)


def _count(value: Any) -> TypeGuard[int]:
    """A non-negative integer (JSON's true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value: Any) -> bool:
    """A finite, non-negative number of seconds (JSON's true is not one)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _optional_str(found: Mapping[str, Any], key: str, what: str) -> str | None:
    value = found.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{what}: {key} is not a string")
    return value or None


@dataclasses.dataclass(frozen=True, slots=True)
class HeartbeatAsk:
    """What the operator says with each beat: the job's attempt as its status has it,
    whether the pod's attempt is over (the sidecar stops waiting for other ranks' parts:
    they are being torn down), the checkpoint request, if any (an opaque id: a new one
    asks the trainer to save at its next step boundary and stop, docs/operator.md), and
    the pod's place in the current attempt (``Assignment``, ``ctj_contract.launch``): one
    newer than the sidecar's restarts the pod's worker in place."""

    attempt: int
    ended: bool = False
    checkpoint_request: str | None = None
    assignment: Assignment | None = None

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "attempt": self.attempt,
            "ended": self.ended,
            "request": self.checkpoint_request,
        }
        if self.assignment is not None:
            body["assignment"] = self.assignment.to_json()
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> HeartbeatAsk:
        """Raises ValueError for anything malformed (the bytes come off the network)."""
        found = _message(raw, "heartbeat")
        attempt, ended = found.get("attempt"), found.get("ended", False)
        if not _count(attempt):
            raise ValueError("heartbeat: attempt is not a non-negative integer")
        if not isinstance(ended, bool):
            raise ValueError("heartbeat: ended is not a boolean")
        placed = found.get("assignment")
        assignment = None if placed is None else Assignment.from_json(placed)
        if assignment is not None and assignment.attempt != attempt:
            raise ValueError("heartbeat: the assignment is for another attempt")
        return cls(attempt, ended, _optional_str(found, "request", "heartbeat"), assignment)


@dataclasses.dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """The sidecar's answer: which attempt and node rank it serves (a reply from a pod of
    another attempt, e.g. an IP reused, is not a beat), the checkpoint request it has
    taken, and, from node rank 0, the last committed checkpoint (``LastCheckpoint``).
    ``node_rank`` None: the sidecar is not told its rank (a PyTorchJob's Worker template,
    stamped out by the Kubeflow controller). ``trainer_silent_s``: seconds since the
    pod's longest-silent trainer last ran (its liveness pulse, trainer_sidecar/liveness.py);
    None where no trainer of the pod has a pulse (starting, finished, not using ctj).
    ``worker_exit``: the exit status of this attempt's worker where it ended and the pod
    runs on under its launcher (minus the signal that killed it; ``ctj_contract.launch``),
    None while it runs; ``worker_message`` the last line it printed."""

    attempt: int
    node_rank: int | None
    request_seen: str | None = None
    last_checkpoint: str | None = None
    trainer_silent_s: float | None = None
    worker_exit: int | None = None
    worker_message: str | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "attempt": self.attempt,
                "nodeRank": self.node_rank,
                "requestSeen": self.request_seen,
                "lastCheckpoint": self.last_checkpoint,
                "trainerSilentSeconds": (
                    None if self.trainer_silent_s is None else round(self.trainer_silent_s, 3)
                ),
                "workerExit": self.worker_exit,
                "workerMessage": self.worker_message,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> HeartbeatReply:
        found = _message(raw, "heartbeat reply")
        attempt, rank = found.get("attempt"), found.get("nodeRank")
        if not (_count(attempt) and (rank is None or _count(rank))):
            raise ValueError("heartbeat reply: attempt or nodeRank is not a non-negative integer")
        silent = found.get("trainerSilentSeconds")
        if silent is not None and not _seconds(silent):
            raise ValueError("heartbeat reply: trainerSilentSeconds is not a finite number >= 0")
        code = found.get("workerExit")
        if code is not None and (not isinstance(code, int) or isinstance(code, bool)):
            raise ValueError("heartbeat reply: workerExit is not an integer")
        return cls(
            attempt,
            rank,
            _optional_str(found, "requestSeen", "heartbeat reply"),
            _optional_str(found, "lastCheckpoint", "heartbeat reply"),
            None if silent is None else float(silent),
            code,
            _optional_str(found, "workerMessage", "heartbeat reply"),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class LastCheckpoint:
    """The last committed checkpoint, as rank 0's sidecar reports it and as the job's
    ``status.lastCheckpoint`` shows it: the operator holds no S3 credentials."""

    step: int
    time: str  # RFC 3339, to the second
    bytes: int | None = None  # the state's logical size

    def encode(self) -> str:
        """Compact JSON (the annotation's value)."""
        return json.dumps(
            {"step": self.step, "time": self.time, "bytes": self.bytes}, separators=(",", ":")
        )

    @classmethod
    def decode(cls, value: str | None) -> LastCheckpoint | None:
        """The annotation's value, or None where it is missing or malformed (it is read
        from an object the pods may write: never trusted to parse)."""
        if not value:
            return None
        try:
            found = json.loads(value)
            raw_bytes = found.get("bytes")
            return cls(
                step=int(found["step"]),
                time=str(found.get("time", "")),
                bytes=None if raw_bytes is None else int(raw_bytes),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def as_status(self) -> dict[str, Any]:
        return {"step": self.step, "time": self.time, "bytes": self.bytes}
