"""The training script's API: save a step's state, load the latest committed one.

    ckpt = Checkpointer(CheckpointConfig(uri="s3://bucket/jobs/demo"))
    restored = ckpt.load(model=model, optimizer=opt, extra=extra)   # None on a fresh start
    ...
    ckpt.save(step, model=model, optimizer=opt, extra={"step": step, "data_pos": pos})

Every rank calls both (they are collective). State goes through DCP's own
state_dict helpers and planners, so DDP (replicated) and FSDP2/DTensor
(sharded) models and their optimizer state load at any world size.

``extra`` is a dict of plain values saved once (replicated: rank 0's values win
DCP's deduplication) and loaded into every rank.

A save here runs in the caller's process: stage to a local directory, upload
this rank's part, and rank 0 commits once every rank's part is stored.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from . import __version__, collectives, repository
from .chunk_reader import ChunkReader
from .config import CheckpointConfig
from .dcp_storage import ChunkedStorageReader, StagingWriter, read_items
from .errors import CheckpointError, CorruptCheckpointError
from .manifest import METADATA_FILE, Manifest, rank_file_name
from .objectstore import ObjectStore
from .policy import plan_save
from .store_s3 import S3Settings, open_store
from .uploader import StagedFile, UploadSettings, upload_rank

log = logging.getLogger("ctj.checkpoint")


@dataclasses.dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    mode: str
    logical_bytes: int
    uploaded_bytes: int
    deduplicated_bytes: int
    stage_seconds: float
    total_seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    step: int
    extra: dict[str, Any]
    skipped: tuple[int, ...]  # newer checkpoints that were unusable
    bytes_fetched: int
    seconds: float


def build_state(model: torch.nn.Module, optimizer: Any, extra: dict[str, Any] | None) -> dict:
    """The DCP state dict: model, optimizer (FQN-keyed, sharded as the model is), extra."""
    optimizers = [] if optimizer is None else [optimizer]
    model_sd, optim_sd = get_state_dict(model, optimizers)
    state: dict[str, Any] = {"model": model_sd, "extra": dict(extra or {})}
    if optimizer is not None:
        state["optim"] = optim_sd
    return state


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


class Checkpointer:
    def __init__(
        self,
        config: CheckpointConfig,
        *,
        store: ObjectStore | None = None,
        process_group: Any = None,
    ) -> None:
        self.config = config
        self.store: ObjectStore = store or open_store(
            config.uri, S3Settings.from_env(endpoint_url=config.endpoint_url, region=config.region)
        )
        self.group = process_group
        self.upload_settings = UploadSettings(
            chunk_size=config.chunk_size,
            block_size=config.block_size,
            parallelism=config.parallelism,
            compression=config.compression,
        )

    # -- save -------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> SaveResult:
        """Save and commit ``step``; returns once the checkpoint is committed."""
        started = time.monotonic()
        rank, world = collectives.rank(self.group), collectives.world_size(self.group)
        plan = collectives.decided_by_rank0(
            lambda: plan_save(
                step,
                mode=self.config.mode,
                full_every=self.config.full_every,
                latest=repository.latest_manifest(self.store, before=step),
            ),
            self.group,
        )
        directory = Path(self.config.staging_dir) / f"step-{step:020d}-{rank}"
        shutil.rmtree(directory, ignore_errors=True)
        try:
            dcp.save(
                build_state(model, optimizer, extra),
                storage_writer=StagingWriter(directory),
                process_group=self.group,
            )
            staged = time.monotonic()
            error = self._upload(step, rank, directory, plan.reference_step)
            errors = [e for e in collectives.gather_all(error, self.group) if e]
            if errors:
                raise CheckpointError(f"save of step {step} failed: {errors[0]}")
            manifest = collectives.decided_by_rank0(
                lambda: self._commit(plan, world, staged - started), self.group
            )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        total = time.monotonic() - started
        log.info(
            "committed step %d (%s): %d bytes, %d uploaded, %.2fs",
            step,
            manifest.mode,
            manifest.logical_bytes,
            manifest.uploaded_bytes,
            total,
        )
        return SaveResult(
            step=step,
            mode=manifest.mode,
            logical_bytes=manifest.logical_bytes,
            uploaded_bytes=manifest.uploaded_bytes,
            deduplicated_bytes=manifest.deduplicated_bytes,
            stage_seconds=staged - started,
            total_seconds=total,
        )

    def _upload(self, step: int, rank: int, directory: Path, reference: int | None) -> str | None:
        """Upload this rank's staged files; an error message instead of raising (collective)."""
        try:
            files = [
                StagedFile(
                    rank_file_name(rank),
                    str(directory / rank_file_name(rank)),
                    read_items(directory, rank),
                )
            ]
            if (directory / METADATA_FILE).exists():
                files.append(StagedFile(METADATA_FILE, str(directory / METADATA_FILE), ()))
            known = (
                repository.read_manifest(self.store, reference).chunk_ids()
                if reference is not None
                else set()
            )
            upload_rank(
                self.store,
                step=step,
                rank=rank,
                files=files,
                reference=known,
                settings=self.upload_settings,
            )
            return None
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            log.exception("rank %d failed to upload step %d", rank, step)
            return f"rank {rank}: {exc}"

    def _commit(self, plan: Any, world: int, stage_seconds: float) -> Manifest:
        manifest = repository.commit(
            self.store,
            plan,
            world_size=world,
            block_size=self.config.block_size,
            timings={"stage": stage_seconds},
            versions={"ctj": __version__, "torch": torch.__version__},
        )
        if repository.apply_retention(self.store, self.config.keep_last):
            try:
                repository.collect_garbage(self.store, grace_s=self.config.gc_grace_s)
            except Exception:  # noqa: BLE001 - gc is best effort; the commit stands
                log.exception("garbage collection after step %d failed", plan.step)
        return manifest

    # -- load -------------------------------------------------------------------

    def load(
        self,
        *,
        model: torch.nn.Module,
        optimizer: Any = None,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
    ) -> LoadResult | None:
        """Load the newest usable committed checkpoint (at or before ``step``) in place.

        Returns None when there is none. A checkpoint whose chunks are missing or
        corrupt is skipped with a warning, and the previous one is tried.
        """
        started = time.monotonic()
        steps = collectives.decided_by_rank0(
            lambda: [
                s
                for s in reversed(repository.committed_steps(self.store))
                if step is None or s <= step
            ],
            self.group,
        )
        if not steps:
            return None
        state = build_state(model, optimizer, extra)
        skipped: list[int] = []
        for candidate in steps:
            manifest = repository.read_manifest(self.store, candidate)
            reader = ChunkReader(self.store, manifest, parallelism=self.config.parallelism)
            try:
                dcp.load(
                    state,
                    storage_reader=ChunkedStorageReader(reader),
                    process_group=self.group,
                )
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                corrupt = find_corruption(exc)
                if corrupt is None:
                    raise _explain_load_failure(exc, candidate) from None
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
            return LoadResult(
                step=candidate,
                extra=state["extra"],
                skipped=tuple(skipped),
                bytes_fetched=reader.stats.bytes_fetched,
                seconds=time.monotonic() - started,
            )
        raise CheckpointError(
            f"no usable checkpoint: all {len(steps)} committed checkpoints are corrupt "
            "(run `ctj checkpoints verify` for details)"
        )
