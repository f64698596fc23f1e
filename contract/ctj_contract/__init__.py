"""The contract between the operator and the pods it makes: every name that crosses.

The operator writes these names into the objects it creates (labels, annotations,
environment variables, Leases); the engine and its sidecar read them back in the pod,
and write the heartbeat and the last-checkpoint report the operator reads. Both sides
import this module, so a name is spelled once; tests/unit/test_contract.py builds a pod
with the operator's builders and starts the engine's configuration from its environment.

Plain Python only: the operator imports it without torch, the sidecar without kopf.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Mapping
from typing import Any

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
    RESTARTED = "Restarted"
    """Why the last attempt ended; True from the first restart on (status.restarts and
    status.nodeRestarts count them)."""
    SPEC_PENDING = "SpecPending"
    """True while the spec was changed after the running attempt started (status.
    attemptGeneration < metadata.generation): the change applies at the next attempt."""


# -- labels and annotations ---------------------------------------------------------------

LABEL_JOB = f"{GROUP}/job-name"
"""On every object of a job: the job's name (the operator's watches select on it)."""
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_RANK = f"{GROUP}/node-rank"
LABEL_WORLD = f"{GROUP}/world-size"

ANNOTATION_LAST_CHECKPOINT = f"{GROUP}/last-checkpoint"
"""On rank 0's heartbeat Lease, written by its sidecar: a ``LastCheckpoint``, as JSON."""
ANNOTATION_CHECKPOINT_REQUEST = f"{GROUP}/checkpoint-request"
"""On every rank's Lease, written by the operator: an opaque id; a new one asks the
trainer to save at its next step boundary (a planned transition)."""


# -- environment variables the operator sets in the pods ----------------------------------


class Env:
    """The ``CTJ_*`` (and AWS's, and torch's) variables the operator sets in a rank's
    containers, by what they carry. Plain strings: they go into objects sent as JSON."""

    # where and how to save (trainer and sidecar)
    CHECKPOINT_URI = "CTJ_CHECKPOINT_URI"
    CHECKPOINT_MODE = "CTJ_CHECKPOINT_MODE"
    CHECKPOINT_FULL_EVERY = "CTJ_CHECKPOINT_FULL_EVERY"
    CHECKPOINT_KEEP_LAST = "CTJ_CHECKPOINT_KEEP_LAST"
    STAGING_DIR = "CTJ_STAGING_DIR"
    SIDECAR = "CTJ_SIDECAR"
    """"1": a sidecar process persists what the trainer stages."""
    RESUME_FROM = "CTJ_RESUME_FROM"
    """A job with no committed checkpoint of its own is seeded from the newest committed one
    here (spec.checkpoint.resumeFrom), read-only: a checkpoint location URI; or, with
    ``RESUME_FROM_JOB``, the directory that holds a job's locations (``<uri>/<namespace>``)."""
    RESUME_FROM_JOB = "CTJ_RESUME_FROM_JOB"
    """spec.checkpoint.resumeFrom named a job: its locations are ``RESUME_FROM/<name>-<uid>``
    (every uid the name had); the trainer seeds from the newest commit among them."""
    S3_ENDPOINT = "AWS_ENDPOINT_URL"
    S3_ACCESS_KEY = "AWS_ACCESS_KEY_ID"
    S3_SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
    # the trainer
    SAVE_EVERY = "CTJ_SAVE_EVERY"
    ATTEMPT = "CTJ_ATTEMPT"
    """Part of every save's identity: nothing an older attempt left can enter a commit."""
    NODE_RANK = "NODE_RANK"
    # the sidecar
    METRICS_HOST = "CTJ_METRICS_HOST"
    HEARTBEAT_LEASE = "CTJ_HEARTBEAT_LEASE"
    POD_NAMESPACE = "CTJ_POD_NAMESPACE"
    HEARTBEAT_PERIOD_S = "CTJ_HEARTBEAT_PERIOD_S"
    # the node-local chunk cache and its peers
    CACHE_DIR = "CTJ_CACHE_DIR"
    CACHE_MAX_BYTES = "CTJ_CACHE_MAX_BYTES"
    CACHE_PEERS = "CTJ_CACHE_PEERS"
    """host:port of every pod's cache server, in node-rank order, comma-separated."""
    CACHE_TOKEN = "CTJ_CACHE_TOKEN"
    CACHE_PORT = "CTJ_CACHE_PORT"


CACHE_TOKEN_KEY = "token"
"""The key of the job's cache Secret that holds ``Env.CACHE_TOKEN``."""


# -- the heartbeat: a merge patch of the rank's Lease -------------------------------------


def micro_time(ts: float) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with microseconds, 2026-12-01T12:00:00.123456Z."""
    us = round(ts * 1_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(us // 1_000_000)) + (
        f".{us % 1_000_000:06d}Z"
    )


def rfc3339(ts: float) -> str:
    """RFC 3339 in UTC to the second (the form the job's status uses)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def heartbeat_patch(renew: float, last_checkpoint: str | None = None) -> dict[str, Any]:
    """One beat: the Lease's renewTime, and rank 0's last-checkpoint report when it is to
    be sent (``LastCheckpoint.encode()``)."""
    body: dict[str, Any] = {"spec": {"renewTime": micro_time(renew)}}
    if last_checkpoint is not None:
        body["metadata"] = {"annotations": {ANNOTATION_LAST_CHECKPOINT: last_checkpoint}}
    return body


def checkpoint_request_patch(request_id: str) -> dict[str, Any]:
    """The operator's merge patch of a rank's Lease that asks for a checkpoint."""
    return {"metadata": {"annotations": {ANNOTATION_CHECKPOINT_REQUEST: request_id}}}


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


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    metadata = obj.get("metadata") or {}
    return dict(metadata.get("annotations") or {})
