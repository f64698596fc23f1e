"""Configuration of the checkpoint engine: one dataclass, validated on construction.

Environment variables are read only by ``CheckpointConfig.from_env`` (the entry
points call it); everything below takes a config object.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctj_contract import NODE_AGENT_PORT, Env

from .errors import CheckpointError
from .format.chunking import DEFAULT_BLOCK_SIZE, DEFAULT_CHUNK_SIZE, MIB
from .format.codecs import Compression
from .format.manifest import Mode
from .store.base import Location

_ATTEMPT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_JOB_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def default_staging_root() -> str:
    """CTJ_STAGING_DIR if set; else memory-backed where the machine has it (/dev/shm),
    the temp dir otherwise."""
    if os.environ.get(Env.STAGING_DIR):
        return os.environ[Env.STAGING_DIR]
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"ctj-staging-{os.getuid()}")


class BusyPolicy(enum.StrEnum):
    WAIT = "wait"  # a save that finds every slot uploading waits for one
    SKIP = "skip"  # ... or is skipped (counted) and training goes on


class _FieldError(CheckpointError):
    """A field's value is refused: ``from_env`` names the variable it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _enum(field: str, kind: type[enum.StrEnum], value: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise _FieldError(
            field, f"checkpoint config: {field} is {value!r}: use one of {choices}"
        ) from None


TRUST_PICKLED_ENV = "CTJ_TRUST_PICKLED_VALUES"
CACHE_DIR_ENV = "CTJ_CACHE_DIR"
CACHE_MAX_BYTES_ENV = "CTJ_CACHE_MAX_BYTES"
"""A node cache in a directory, for runs outside a cluster (in a pod: the node agent's)."""


def _flag(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(value)


def env_flag(var: str, value: str) -> bool:
    """A boolean setting ``var`` (1/true/yes/on, 0/false/no/off, empty: no); anything else
    is a one-line error naming it, never a silent "no"."""
    try:
        return _flag(value)
    except ValueError:
        raise CheckpointError(f"{var}={value!r} is not a boolean: use 1 or 0") from None


_KIND_FIX = {int: "a whole number", float: "a number", _flag: "1 or 0"}
"""What a variable of each parse takes, for its error."""


def _peer_list(value: str) -> tuple[str, ...]:
    """CTJ_CACHE_PEERS: comma-separated host:port, one per pod of the attempt, in node-rank
    order (this pod's own entry included: store/peers.own_index finds it)."""
    return tuple(p.strip() for p in value.split(",") if p.strip())


def job_staging_dir(config: CheckpointConfig) -> Path:
    """One staging directory per job (URI), so jobs on one machine never share slots."""
    return Path(config.staging_dir) / hashlib.sha256(config.uri.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    uri: str
    """Where the job's checkpoints live: s3://bucket/prefix or file:///dir."""
    mode: Mode = Mode.INCREMENTAL
    """full | incremental (vs the previous checkpoint) | differential (vs the last full)."""
    full_every: int = 10
    """Every N-th checkpoint is a full one (1 = always full)."""
    keep_last: int = 3
    """Committed checkpoints to keep (plus any base they need); 0 keeps all."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Largest chunk (bytes); a multiple of block_size, at most 64 MiB."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Unit of verification and of ranged reads (bytes)."""
    compression: Compression = Compression.NONE
    """none | zstd | auto: auto stores each chunk of one fp32 / bf16 / fp16 tensor as
    zstd-compressed byte planes, every other chunk as zstd (docs/format.md, Codecs).
    Compressed chunks are read whole; a chunk that would barely shrink is stored raw."""
    parallelism: int = 8
    """Concurrent chunk transfers per rank."""
    gc_grace_s: float = 3600.0
    """Never delete a chunk younger than this: a save in flight may be writing it."""
    commit_timeout_s: float = 600.0
    """How long the committer waits for every rank's part."""
    staging_dir: str = dataclasses.field(default_factory=default_staging_root)
    """Local directory for staged state (memory-backed in a pod)."""
    endpoint_url: str | None = None
    """S3 endpoint (MinIO, SeaweedFS, ...); None: AWS or AWS_ENDPOINT_URL."""
    region: str | None = None
    sidecar: bool = False
    """True: a sidecar process persists what this process stages; False: a thread here does."""
    staging_slots: int = 1
    """Staged copies a rank may hold (host memory = slots x the rank's state)."""
    busy_policy: BusyPolicy = BusyPolicy.WAIT
    """When every slot is still uploading: wait (block the save) or skip (count it, go on)."""
    slot_wait_timeout_s: float = 600.0
    """How long a save waits for a free slot before failing."""
    shutdown_grace_s: float = 25.0
    """On shutdown (SIGTERM), how long to keep persisting what is staged."""
    metrics_port: int | None = None
    """Serve /metrics, /healthz, /readyz on this port (None: don't serve)."""
    attempt: str = "0"
    """Which attempt of the job this process belongs to (the operator's CTJ_ATTEMPT): part
    of every save's identity, so nothing an earlier attempt left can enter a commit."""
    trust_pickled_values: bool = False
    """Load non-tensor values with full pickle instead of torch's weights_only rules
    (plain containers, numbers, strings, tensors). Only for checkpoints you wrote and
    nobody else can write to: a pickle can run code."""
    cache_dir: str | None = None
    """A node-local chunk cache in a directory, for runs outside a cluster (in a pod the
    node agent holds the node's cache: ``node_agent``): every chunk saved is kept here,
    and a restore reads it first. None: no cache."""
    cache_max_bytes: int = 16 << 30
    """Bound of the node-local cache; the least recently used chunks go beyond it."""
    cache_peers: tuple[str, ...] = ()
    """host:port of every pod's cache server, in node-rank order (this pod's included, and
    skipped when reading): read before S3 on a restore."""
    cache_port: int | None = None
    """The sidecar serves this node's cache to the peers on this port (None: doesn't)."""
    cache_token: str | None = dataclasses.field(default=None, repr=False)
    """The job's secret for the peer caches (CTJ_CACHE_TOKEN); never logged."""
    node_agent: str | None = None
    """host:port of the node agent that holds this node's cache (in a pod: the node's
    address and the agent's hostPort); used instead of ``cache_dir``, with the job below."""
    node_cache_mount: str | None = None
    """Where the job's directory of the node agent's cache is mounted read-only (the
    agent's CSI volume, CTJ_NODE_CACHE_MOUNT): the node's chunks are read there."""
    job_namespace: str | None = None
    job_name: str | None = None
    job_uid: str | None = None
    """The job (CTJ_JOB_*): its path on the node agents, which check its token against it."""
    resume_from: str | None = None
    """Seed a run whose location holds no committed checkpoint yet from the newest committed
    one here, read-only (CTJ_RESUME_FROM; spec.checkpoint.resumeFrom): a checkpoint location,
    or with ``resume_from_job`` the directory holding that job's locations. Read with this
    config's endpoint and credentials."""
    resume_from_job: str | None = None
    """A job's name (CTJ_RESUME_FROM_JOB): its locations are ``resume_from/<name>-<uid>``, one
    per uid; the newest commit among them is the source (load/resume.py)."""

    def __post_init__(self) -> None:
        try:
            Location.parse(self.uri)  # raises a CheckpointError naming the problem
        except CheckpointError as exc:
            raise _FieldError("uri", str(exc)) from None

        def bad(field: str, why: str) -> CheckpointError:
            return _FieldError(field, f"checkpoint config: {field} {why}")

        # enums accept their values as strings (from the environment, from YAML)
        object.__setattr__(self, "mode", _enum("mode", Mode, self.mode))
        object.__setattr__(self, "compression", _enum("compression", Compression, self.compression))
        object.__setattr__(self, "busy_policy", _enum("busy_policy", BusyPolicy, self.busy_policy))
        if self.full_every < 1:
            raise bad("full_every", f"is {self.full_every}: use 1 or more")
        if self.keep_last < 0:
            raise bad("keep_last", f"is {self.keep_last}: use 0 (keep all) or more")
        if self.block_size < 4096 or self.block_size & (self.block_size - 1):
            raise bad("block_size", f"is {self.block_size}: use a power of two >= 4096")
        if self.chunk_size % self.block_size or not 0 < self.chunk_size <= 64 * MIB:
            raise bad("chunk_size", "must be a multiple of block_size, at most 64 MiB")
        if self.parallelism < 1:
            raise bad("parallelism", "must be at least 1")
        if self.gc_grace_s < 0 or self.commit_timeout_s <= 0:
            raise bad("gc_grace_s/commit_timeout_s", "must be positive")
        if self.staging_slots < 1:
            raise bad("staging_slots", f"is {self.staging_slots}: use 1 or more")
        if not _ATTEMPT.fullmatch(self.attempt):
            raise bad("attempt", f"is {self.attempt!r}: use 1-64 of A-Z a-z 0-9 . _ -")
        if self.shutdown_grace_s < 0 or self.slot_wait_timeout_s <= 0:
            raise bad("shutdown_grace_s/slot_wait_timeout_s", "must be positive")
        if self.cache_dir is not None and self.cache_max_bytes < self.chunk_size:
            raise bad("cache_max_bytes", f"is {self.cache_max_bytes}: use at least chunk_size")
        if self.resume_from is not None:
            try:
                Location.parse(self.resume_from)
            except CheckpointError as exc:
                raise _FieldError("resume_from", f"checkpoint config: resume_from: {exc}") from None
        if self.resume_from_job is not None and (
            self.resume_from is None or not _JOB_NAME.fullmatch(self.resume_from_job)
        ):
            raise bad(
                "resume_from_job",
                f"is {self.resume_from_job!r}: use a job's name (a-z 0-9 - .) together with "
                "resume_from (the directory of its locations)",
            )
        object.__setattr__(self, "cache_peers", tuple(p for p in self.cache_peers if p))
        if self.node_agent is not None:
            job = (self.job_namespace, self.job_name, self.job_uid)
            if not all(job) or not self.cache_token:
                raise bad(
                    "node_agent",
                    "(CTJ_NODE_AGENT_HOST) needs the job's CTJ_JOB_NAMESPACE, CTJ_JOB_NAME, "
                    "CTJ_JOB_UID and CTJ_CACHE_TOKEN: the operator sets them together",
                )
        if (self.cache_peers or self.cache_port is not None) and (
            self.cache_token is None or len(self.cache_token) < 16
        ):
            raise bad(
                "cache_token",
                "(CTJ_CACHE_TOKEN) must be a secret of 16+ characters to serve or read "
                "peer caches: the operator sets it from the job's Secret",
            )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> CheckpointConfig:
        """CTJ_CHECKPOINT_URI, CTJ_CHECKPOINT_MODE, ... (``ctj_contract.Env``: the operator
        sets those in pods; the others are the user's)."""
        env = dict(os.environ if env is None else env)
        names: dict[str, tuple[str, Callable[[str], Any]]] = {
            "uri": (Env.CHECKPOINT_URI, str),
            "mode": (Env.CHECKPOINT_MODE, str),
            "full_every": (Env.CHECKPOINT_FULL_EVERY, int),
            "keep_last": (Env.CHECKPOINT_KEEP_LAST, int),
            "chunk_size": ("CTJ_CHECKPOINT_CHUNK_SIZE", int),
            "block_size": ("CTJ_CHECKPOINT_BLOCK_SIZE", int),
            "compression": ("CTJ_CHECKPOINT_COMPRESSION", str),
            "parallelism": ("CTJ_CHECKPOINT_PARALLELISM", int),
            "staging_dir": (Env.STAGING_DIR, str),
            "endpoint_url": (Env.S3_ENDPOINT, str),
            "sidecar": (Env.SIDECAR, _flag),
            "staging_slots": ("CTJ_STAGING_SLOTS", int),
            "busy_policy": ("CTJ_BUSY_POLICY", str),
            "shutdown_grace_s": ("CTJ_SHUTDOWN_GRACE_S", float),
            "metrics_port": ("CTJ_METRICS_PORT", int),
            "attempt": (Env.ATTEMPT, str),
            "trust_pickled_values": (TRUST_PICKLED_ENV, _flag),
            "cache_dir": (CACHE_DIR_ENV, str),
            "cache_max_bytes": (CACHE_MAX_BYTES_ENV, int),
            "cache_peers": (Env.CACHE_PEERS, _peer_list),
            "cache_port": (Env.CACHE_PORT, int),
            "cache_token": (Env.CACHE_TOKEN, str),
            "node_agent": (Env.NODE_AGENT_HOST, str),
            "node_cache_mount": (Env.NODE_CACHE_MOUNT, str),
            "job_namespace": (Env.JOB_NAMESPACE, str),
            "job_name": (Env.JOB_NAME, str),
            "job_uid": (Env.JOB_UID, str),
            "resume_from": (Env.RESUME_FROM, str),
            "resume_from_job": (Env.RESUME_FROM_JOB, str),
        }
        values: dict[str, Any] = {}
        for field, (var, typ) in names.items():
            if env.get(var):
                try:
                    values[field] = typ(env[var])
                except ValueError:
                    kind = getattr(typ, "__name__", "value").strip("_")
                    fix = _KIND_FIX.get(typ, f"a {kind}")
                    raise CheckpointError(
                        f"{var}={env[var]!r} is not a valid {kind}: set it to {fix}"
                    ) from None
        if "node_agent" in values:  # the node's address, and the agent's port beside it
            port = env.get(Env.NODE_AGENT_PORT) or str(NODE_AGENT_PORT)
            host = values["node_agent"]
            values["node_agent"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        values.update(overrides)
        if "uri" not in values:
            raise CheckpointError(
                "no checkpoint location: set CTJ_CHECKPOINT_URI (s3://bucket/prefix)"
            )
        try:
            return cls(**values)
        except _FieldError as exc:  # a value refused: name the variable it came from
            source = names[exc.field][0] if exc.field in names else None
            if source is None or exc.field in overrides or not env.get(source):
                raise
            raise CheckpointError(f"{source}: {exc}") from None  # the value: never echoed here
