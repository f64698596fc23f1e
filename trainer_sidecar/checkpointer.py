"""The training script's API: save a step's state, load the latest committed one.

    ckpt = Checkpointer(CheckpointConfig(uri="s3://bucket/jobs/demo"))
    restored = ckpt.load(model=model, optimizer=opt, extra=extra)   # None on a fresh start
    ...
    pending = ckpt.save(step, model=model, optimizer=opt, extra={"step": step})
    # training may go on (and touch the parameters) as soon as save() returns
    pending.result()   # optional: block until that checkpoint is committed

Every rank calls save and load (they are collective). State goes through
DCP's own state_dict helpers and planners, so DDP (replicated) and
FSDP2/DTensor (sharded) models and their optimizer state load at any world size.

``save`` returns when the state is copied into this rank's staging slot (one
copy into reused, memory-backed pages): from then on the parameters may
change. A persister (a thread here, or the sidecar process when
``config.sidecar``) uploads the slot and rank 0's commits the manifest.

``extra`` is a dict of plain values saved once (replicated: rank 0's values win
DCP's deduplication) and loaded into every rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from . import __version__, collectives
from .config import CheckpointConfig, job_staging_dir
from .errors import CheckpointError, CorruptCheckpointError, NoCheckpointError, ObjectNotFound
from .format.manifest import METADATA_FILE, manifest_key
from .format.policy import Committed, plan_save
from .load.chunk_reader import ChunkReader
from .load.dcp_reader import ChunkedStorageReader
from .metrics import CheckpointMetrics, serve
from .save import protocol as layout_cache
from .save import staging
from .save.persist import Persister
from .save.protocol import SaveReport, SlotState, Staging
from .save.staging import StagingWriter
from .store import repository
from .store.base import ObjectStore
from .store_s3 import S3Settings, open_store

log = logging.getLogger("ctj.checkpoint")


@dataclasses.dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    mode: str
    logical_bytes: int
    uploaded_bytes: int
    deduplicated_bytes: int
    stage_seconds: float  # how long save() blocked the training loop
    total_seconds: float  # from save() to the commit being visible


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


_OPEN: set[tuple[Path, int]] = set()  # (staging dir, rank) with a live persister thread
_OPEN_LOCK = threading.Lock()


class PendingSave:
    """A staged save. ``result()`` blocks until its checkpoint is committed."""

    def __init__(
        self, owner: Checkpointer, step: int, started: float, stall: float, *, replanned: bool
    ) -> None:
        self.owner = owner
        self.step = step
        self.stage_seconds = stall
        self.replanned = replanned  # DCP planned it (first save, or a rank's layout changed)
        self._started = started
        self._result: SaveResult | None = None

    def done(self) -> bool:
        try:
            self.owner.store.get(manifest_key(self.step), byte_range=(0, 1))
            return True
        except ObjectNotFound:
            return False

    def result(self, timeout: float | None = None) -> SaveResult:
        if self._result is not None:
            return self._result
        limit = self.owner.config.commit_timeout_s * 2 if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = 0.005
        while True:
            try:  # retired too: retention may remove a commit at once (older than the kept)
                manifest = repository.read_manifest(self.owner.store, self.step, retired_too=True)
                break
            except NoCheckpointError:
                failure = self.owner.persist_failure(self.step)
                if failure:
                    raise CheckpointError(f"save of step {self.step} failed: {failure}") from None
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"step {self.step} was not committed within {limit:.0f}s "
                        "(is the sidecar running? see its log)"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        self._result = SaveResult(
            step=self.step,
            mode=manifest.mode,
            logical_bytes=manifest.logical_bytes,
            uploaded_bytes=manifest.uploaded_bytes,
            deduplicated_bytes=manifest.deduplicated_bytes,
            stage_seconds=self.stage_seconds,
            total_seconds=time.monotonic() - self._started,
        )
        return self._result


class Checkpointer:
    def __init__(
        self,
        config: CheckpointConfig,
        *,
        store: ObjectStore | None = None,
        process_group: Any = None,
        metrics: CheckpointMetrics | None = None,
    ) -> None:
        self.config = config
        self.store: ObjectStore = store or open_store(
            config.uri, S3Settings.from_env(endpoint_url=config.endpoint_url, region=config.region)
        )
        self.group = process_group
        self.rank = collectives.rank(process_group)
        self.root = job_staging_dir(config)
        self.metrics = metrics or CheckpointMetrics()
        self._preempted = False
        self._persister: Persister | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._layout: layout_cache.Layout | None = None  # the last planned save's, reused
        self._checked_behind = False  # rank 0: _warn_if_behind ran
        self._metadata_blob: tuple[tuple[Any, ...], bytes] | None = None  # (values' places, pickle)
        self._server = (
            serve(config.metrics_port, self.metrics) if config.metrics_port is not None else None
        )

    # -- save -------------------------------------------------------------------

    def _start_persister(self) -> None:
        """In-process mode: the thread that does a sidecar's job, started by the first save."""
        if self.config.sidecar or self._thread is not None:
            return
        with _OPEN_LOCK:
            if (self.root, self.rank) in _OPEN:
                raise CheckpointError(
                    f"another Checkpointer is already saving to {self.config.uri} in this "
                    "process: close() it first, or reuse it"
                )
            _OPEN.add((self.root, self.rank))
        self._persister = Persister(
            self.store,
            self.config,
            root=self.root,
            metrics=self.metrics,
            rank=self.rank,
            versions={"ctj": __version__, "torch": torch.__version__},
        )
        self._thread = threading.Thread(
            target=self._persister.run,
            args=(self._stop,),
            kwargs={"grace_s": self.config.shutdown_grace_s},
            name="ctj-persist",
            daemon=True,
        )
        self._thread.start()
        atexit.register(self.close)

    def _latest(self, step: int) -> Committed | None:
        """The latest commit before ``step``: from the persister's state file, else the store."""
        known = staging.read_state(self.root, self.config.uri)
        if known is not None and known.step < step:
            return known
        latest = repository.latest_manifest(self.store, before=step)
        return Committed.of(latest) if latest else None

    def _acquire_slot(self) -> tuple[Path | None, SlotState]:
        """This rank's free slot (waiting for one under busy_policy "wait"); no collectives."""
        slots = self.config.staging_slots
        if self.config.busy_policy == "skip":
            slot = staging.free_slot(self.root, self.rank, slots)
            return slot, SlotState.FREE if slot else SlotState.BUSY
        slot = staging.wait_free_slot(self.root, self.rank, slots, self.config.slot_wait_timeout_s)
        return slot, SlotState.FREE if slot else SlotState.TIMED_OUT

    def _report(
        self,
        step: int,
        slot: Path | None,
        slot_state: SlotState,
        planner: Any,
        items: tuple[Any, ...],
    ) -> tuple[SaveReport, list[memoryview]]:
        """This rank's part of the one exchange before staging, and its serialized values."""
        layout = self._layout
        reuse = slot is not None and layout is not None and layout.matches(items)
        blobs: list[memoryview] = []
        placed: list[Any] = []
        if reuse and layout is not None:
            try:
                blobs = staging.serialize_bytes(layout.byte_items, planner)
                placed = staging.byte_results(self.rank, layout.byte_items, blobs)
            except Exception as exc:  # noqa: BLE001 - DCP's replan reports it on every rank
                log.warning(
                    "rank %d: serializing the non-tensor values failed (%s)", self.rank, exc
                )
                reuse = False
        plan, error = None, None
        if self.rank == 0:
            try:
                plan = plan_save(
                    step,
                    mode=self.config.mode,
                    full_every=self.config.full_every,
                    latest=self._latest(step),
                )
                self._warn_if_behind(step)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by decide()
                error = exc
        report = SaveReport(self.rank, slot_state, reuse, tuple(placed), plan, error)
        return report, blobs

    def _warn_if_behind(self, step: int) -> None:
        """On the first save: warn when saving below the newest checkpoint at this location
        (a run restarted without load): retention would remove the new ones at once."""
        if self._checked_behind:
            return
        self._checked_behind = True
        try:
            steps = repository.committed_steps(self.store)
        except Exception as exc:  # noqa: BLE001 - only a warning: never fail a save for it
            log.debug("could not list checkpoints to compare steps: %s", exc)
            return
        if steps and steps[-1] > step:
            log.warning(
                "saving step %d below the newest checkpoint at %s (step %d): retention keeps "
                "the highest steps, so this run's checkpoints may be removed as soon as they "
                "commit. Load before training, or use a new URI for a new run.",
                step,
                self.config.uri,
                steps[-1],
            )

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> PendingSave | None:
        """Stage ``step`` and return; the state may change as soon as this returns.

        Returns None when the save was skipped (``busy_policy="skip"`` and a
        previous save still uploading).

        Collectives: one all-gather (rank 0's plan, every rank's slot and layout),
        and, only when some rank's layout changed (the first save, new optimizer
        state), DCP's own planning round.
        """
        started = time.monotonic()
        self._start_persister()
        state = build_state(model, optimizer, extra)
        planner, items = layout_cache.local_plan(state, is_coordinator=self.rank == 0)
        slot, slot_state = self._acquire_slot()
        report, blobs = self._report(step, slot, slot_state, planner, items)
        copied = None
        if report.reuse and slot is not None:
            # copy before the exchange: the usual case, wasted only if another rank replans
            copied = self._copy_in_layout(slot, planner, blobs)
            if copied is None:
                report = dataclasses.replace(report, reuse=False, byte_results=())
        reports = collectives.gather_all(report, self.group)
        how, plan = layout_cache.decide(reports, wait_timeout_s=self.config.slot_wait_timeout_s)
        if how is Staging.SKIP:
            self.metrics.skipped.inc()
            log.warning("skipped the save of step %d: the previous one is still uploading", step)
            return None
        assert slot is not None
        try:
            if how is Staging.REUSE and copied is not None:
                files = copied
                self._write_reused_metadata(slot, reports)
            else:
                files = self._replan(slot, state)
        except (Exception, CheckpointException) as exc:
            self._layout = None
            self.metrics.failures.labels(stage="stage").inc()
            raise CheckpointError(f"staging step {step} failed: {exc}") from exc
        if self.rank == 0:
            files.append((METADATA_FILE, ()))
        stall = time.monotonic() - started
        staging.mark_ready(
            slot,
            staging.StagedCheckpoint(
                step=step,
                rank=self.rank,
                world_size=len(reports),
                plan=plan,
                files=tuple(files),
                staged_at=time.time(),
                stage_seconds=stall,
            ),
        )
        self.metrics.stall.observe(stall)
        # no wake-up for an in-process persister: it polls (every 50 ms), and waking it
        # here would hand it the GIL before save() returns
        return PendingSave(self, step, started, stall, replanned=how is Staging.REPLAN)

    def _copy_in_layout(
        self, slot: Path, planner: Any, blobs: list[memoryview]
    ) -> staging.StagedFiles | None:
        """The one copy into the slot, in the last planned layout (None if it failed:
        this rank then asks for a replan, and DCP reports the failure on every rank)."""
        layout = self._layout
        assert layout is not None
        try:
            _, files = staging.stage_items(
                slot, self.rank, layout.tensor_items, layout.byte_items, planner, blobs
            )
            return files
        except Exception as exc:  # noqa: BLE001 - never leave the other ranks in the exchange
            log.warning(
                "rank %d: copying into the staging slot failed (%s): replanning", self.rank, exc
            )
            return None

    def _write_reused_metadata(self, slot: Path, reports: list[SaveReport]) -> None:
        """The coordinator's .metadata: the planned one, with the values where they lie now."""
        layout = self._layout
        if layout is None or layout.metadata is None:  # not the coordinator
            return
        placed = tuple(r for report in reports for r in report.byte_results)
        if self._metadata_blob is None or self._metadata_blob[0] != placed:
            merged = layout_cache.merged_metadata(layout.metadata, placed)
            self._metadata_blob = (placed, pickle.dumps(merged))
        staging.write_metadata(slot, self._metadata_blob[1])

    def _replan(self, slot: Path, state: dict[str, Any]) -> staging.StagedFiles:
        """A DCP save through the staging writer: it plans, copies, and leaves its layout."""
        writer = StagingWriter(slot)
        self._layout, self._metadata_blob = None, None
        dcp.save(
            state, storage_writer=writer, planner=DefaultSavePlanner(), process_group=self.group
        )
        self._layout = layout_cache.Layout.of(writer)
        return list(writer.files)

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is served on (config.metrics_port, or the one 0 picked)."""
        return int(self._server.server_address[1]) if self._server else None

    def persist_failure(self, step: int) -> str | None:
        """Why the in-process persister could not persist ``step`` (None: no failure seen)."""
        return self._persister.failures.get(step) if self._persister else None

    def preemption_requested(self) -> bool:
        """Collective: True on every rank once any rank got SIGTERM (see handle_sigterm)."""
        flag = torch.tensor([1 if self._preempted else 0])
        if collectives.active(self.group):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def handle_sigterm(self) -> None:
        """On SIGTERM, only note it: the loop saves at the next step boundary and exits."""

        def note(signum: int, frame: Any) -> None:
            self._preempted = True

        signal.signal(signal.SIGTERM, note)

    def close(self, timeout: float | None = None) -> None:
        """Finish persisting what is staged (within the shutdown grace), stop the thread.

        In-process, this rank's staging buffers are freed once nothing is left staged;
        with a sidecar they stay for it to upload.
        """
        if self._thread is not None and self._thread.is_alive():
            if self._persister is not None:
                self._persister.shutdown(self._stop, self.config.shutdown_grace_s)
            self._thread.join(self.config.shutdown_grace_s + 5 if timeout is None else timeout)
            if not self._thread.is_alive() and not staging.pending(self.root, self.rank):
                staging.remove_rank(self.root, self.rank)
            with _OPEN_LOCK:
                _OPEN.discard((self.root, self.rank))
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
                self.metrics.failures.labels(stage="restore").inc()
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
            self.metrics.restore.observe(seconds)
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
