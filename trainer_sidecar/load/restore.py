"""Restore: load the newest usable committed checkpoint into the caller's state, in place.

DCP's planner decides what each rank needs (resharding included); the reader
fetches exactly those byte ranges, verified. A checkpoint that turns out
corrupt (a chunk missing or failing its hash) is skipped, loudly, and the
previous one is tried.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_state_dict

from .. import collectives
from ..errors import CheckpointError, CorruptCheckpointError
from ..metrics import CheckpointMetrics
from ..state_dict import build_state
from ..store import repository
from ..store.base import ObjectStore
from .chunk_reader import ChunkReader
from .dcp_reader import ChunkedStorageReader

log = logging.getLogger("ctj.checkpoint")


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    step: int
    extra: dict[str, Any]
    skipped: tuple[int, ...]  # newer checkpoints that were unusable
    bytes_fetched: int
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreSettings:
    parallelism: int = 8
    """Concurrent ranged GETs per rank."""
    trust_pickled_values: bool = False
    """Unpickle non-tensor values without weights_only's restrictions (see CheckpointConfig)."""


def find_corruption(exc: BaseException) -> CorruptCheckpointError | None:
    """The CorruptCheckpointError behind a (possibly DCP-wrapped) exception."""
    if isinstance(exc, CorruptCheckpointError):
        return exc
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and (found := find_corruption(inner)):
                return found
    cause = exc.__cause__ or exc.__context__
    return find_corruption(cause) if cause is not None else None


def _explain_load_failure(exc: BaseException, step: int) -> CheckpointError:
    text = str(exc)
    if isinstance(exc, CheckpointException):
        inner = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        text = "; ".join(sorted({str(i) for i in inner})) or text
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return CheckpointError(
        f"checkpoint step {step} does not match the state being loaded ({first}): "
        "load it into the same model and optimizer that saved it"
    )


def restore(
    store: ObjectStore,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    extra: dict[str, Any] | None,
    step: int | None,
    settings: RestoreSettings,
    metrics: CheckpointMetrics,
    group: Any = None,
) -> LoadResult | None:
    """Collective: every rank calls it; returns None when nothing is committed."""
    started = time.monotonic()
    steps = collectives.decided_by_rank0(
        lambda: [
            s
            for s in reversed(repository.committed_steps(store))
            if step is None or s <= step
        ],
        group,
    )
    if not steps:
        return None
    state = build_state(model, optimizer, extra)
    skipped: list[int] = []
    for candidate in steps:
        manifest = repository.read_manifest(store, candidate)
        reader = ChunkReader(store, manifest, parallelism=settings.parallelism)
        try:
            dcp.load(
                state,
                storage_reader=ChunkedStorageReader(reader),
                process_group=group,
            )
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            corrupt = find_corruption(exc)
            if corrupt is None:
                raise _explain_load_failure(exc, candidate) from None
            metrics.failures.labels(stage="restore").inc()
            log.warning("%s; falling back to the previous checkpoint", corrupt)
            skipped.append(candidate)
            continue
        set_state_dict(
            model,
            [] if optimizer is None else [optimizer],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
        )
        if extra is not None:
            extra.update(state["extra"])
        seconds = time.monotonic() - started
        metrics.restore.observe(seconds)
        return LoadResult(
            step=candidate,
            extra=state["extra"],
            skipped=tuple(skipped),
            bytes_fetched=reader.stats.bytes_fetched,
            seconds=seconds,
        )
    raise CheckpointError(
        f"no usable checkpoint: all {len(steps)} committed checkpoints are corrupt "
        "(run `ctj checkpoints verify` for details)"
    )
