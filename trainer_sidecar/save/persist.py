"""The persister: turns staged checkpoints into committed ones.

For each staged slot (oldest first): read the reference manifest's chunks,
upload this rank's part (uploader.py), free the slot, and, on rank 0, wait for
every rank's part and commit the manifest, then apply retention. It runs in
the sidecar process (sidecar.py) or on a thread of the training process
(checkpointer.py), identically.

Stopping: ``run(stop)`` returns once ``stop`` is set and nothing is staged. A
shutdown with a deadline (SIGTERM grace) finishes what is staged if it can;
past the deadline the upload is abandoned before any commit, so a partial
checkpoint is never visible.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..config import CheckpointConfig
from ..errors import CheckpointError, NoCheckpointError, UploadAborted
from ..format.manifest import Manifest, part_prefix
from ..format.policy import Committed
from ..metrics import CheckpointMetrics
from ..store import repository
from ..store.base import ObjectStore
from . import staging
from .uploader import StagedFile, UploadSettings, upload_rank

log = logging.getLogger("ctj.persist")


class Persister:
    def __init__(
        self,
        store: ObjectStore,
        config: CheckpointConfig,
        *,
        root: Path,
        metrics: CheckpointMetrics,
        rank: int | None = None,
        versions: dict[str, str] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank  # None: every rank staged under root (a sidecar serving a pod)
        self.config = config
        self.root = root
        self.metrics = metrics
        self.versions = versions or {}
        self.settings = UploadSettings(
            chunk_size=config.chunk_size,
            block_size=config.block_size,
            parallelism=config.parallelism,
            compression=config.compression,
        )
        self.deadline: float | None = None  # monotonic; set by shutdown
        self.wake = threading.Event()
        self.failures: dict[int, str] = {}  # step -> why it was not persisted
        self._reference_cache: tuple[int, set[str]] | None = None

    # -- one staged checkpoint ------------------------------------------------

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _reference_chunks(self, step: int | None) -> set[str]:
        if step is None:
            return set()
        if self._reference_cache and self._reference_cache[0] == step:
            return self._reference_cache[1]
        try:
            ids = repository.read_manifest(self.store, step, retired_too=True).chunk_ids()
        except NoCheckpointError:
            log.warning("reference checkpoint %d is gone: uploading every chunk", step)
            ids = set()
        self._reference_cache = (step, ids)
        return ids

    def upload(self, slot: Path, staged: staging.StagedCheckpoint) -> None:
        """Upload one rank's staged checkpoint, write its part, free the slot."""
        started = time.monotonic()
        log.info("uploading step %d (rank %d)", staged.step, staged.rank)
        files = [StagedFile(name, str(slot / name), items) for name, items in staged.files]
        part = upload_rank(
            self.store,
            step=staged.step,
            rank=staged.rank,
            files=files,
            reference=self._reference_chunks(staged.plan.reference_step),
            settings=self.settings,
            should_stop=self._past_deadline,
        )
        staging.release(slot)
        self.metrics.upload.observe(time.monotonic() - started)
        self.metrics.bytes.labels(kind="uploaded").inc(part.uploaded_bytes)
        self.metrics.bytes.labels(kind="deduplicated").inc(part.deduplicated_bytes)
        log.info(
            "rank %d uploaded step %d: %d bytes sent, %d deduplicated",
            staged.rank,
            staged.step,
            part.uploaded_bytes,
            part.deduplicated_bytes,
        )

    def commit(self, staged: staging.StagedCheckpoint) -> Manifest:
        """Rank 0's job: once every rank's part is stored, write the manifest."""
        self._wait_for_parts(staged)
        if self._past_deadline():
            raise UploadAborted(f"step {staged.step}: shutdown grace ran out before the commit")
        manifest = repository.commit(
            self.store,
            staged.plan,
            world_size=staged.world_size,
            block_size=self.config.block_size,
            timings={"stage": staged.stage_seconds, "persist": time.time() - staged.staged_at},
            versions=self.versions,
        )
        staging.write_state(self.root, Committed.of(manifest), self.config.uri)
        self.metrics.commit.observe(max(0.0, time.time() - staged.staged_at))
        self.metrics.bytes.labels(kind="logical").inc(manifest.logical_bytes)
        self.metrics.last_success.set(manifest.created)
        self.metrics.last_step.set(manifest.step)
        log.info(
            "committed step %d (%s, %d bytes uploaded of %d)",
            manifest.step,
            manifest.mode,
            manifest.uploaded_bytes,
            manifest.logical_bytes,
        )
        self._retention(manifest.step)
        return manifest

    def _wait_for_parts(self, staged: staging.StagedCheckpoint) -> None:
        give_up = time.monotonic() + self.config.commit_timeout_s
        delay = 0.01
        while True:
            have = sum(1 for _ in self.store.list(part_prefix(staged.step)))
            if have >= staged.world_size:
                return
            if time.monotonic() >= give_up or self._past_deadline():
                raise CheckpointError(
                    f"step {staged.step}: only {have} of {staged.world_size} ranks uploaded "
                    f"within {self.config.commit_timeout_s:.0f}s; not committing"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _retention(self, step: int) -> None:
        try:
            if repository.apply_retention(self.store, self.config.keep_last):
                repository.collect_garbage(self.store, grace_s=self.config.gc_grace_s)
        except Exception:  # noqa: BLE001 - housekeeping; the commit stands
            log.exception("retention or gc after step %d failed", step)

    # -- the loop ------------------------------------------------------------------

    def publish_latest(self) -> None:
        """Tell the trainer (state.json) what the store's latest commit is, at start-up."""
        latest = repository.latest_manifest(self.store)
        if latest is not None:
            staging.write_state(self.root, Committed.of(latest), self.config.uri)

    def run_once(self) -> bool:
        """Persist everything staged now; False if there was nothing to do.

        Every staged rank is uploaded before any commit is attempted: one sidecar
        may serve several ranks of a step (nprocPerNode > 1), rank 0 among them.
        """
        work = staging.pending(self.root, self.rank)
        to_commit = []
        failed: set[int] = set()
        for slot, staged in work:
            if self._attempt(staged, "upload", functools.partial(self.upload, slot, staged)):
                if staged.rank == 0:
                    to_commit.append(staged)
            else:
                failed.add(staged.step)
                staging.release(slot)
        for staged in to_commit:
            if staged.step in failed:  # a rank of it failed here: no point waiting for it
                continue
            self._attempt(staged, "commit", functools.partial(self.commit, staged))
        return bool(work)

    def _attempt(
        self, staged: staging.StagedCheckpoint, stage: str, fn: Callable[[], object]
    ) -> bool:
        try:
            fn()
            return True
        except UploadAborted as exc:
            log.warning("%s", exc)
            self.metrics.failures.labels(stage=stage).inc()
            raise
        except Exception as exc:  # noqa: BLE001 - counted and logged; the job trains on
            self.metrics.failures.labels(stage=stage).inc()
            self.failures[staged.step] = str(exc)
            log.error("step %d (rank %d) not persisted: %s", staged.step, staged.rank, exc)
            return False

    def shutdown(self, stop: threading.Event, grace_s: float) -> None:
        """Ask run() to finish: what is staged gets ``grace_s`` more, counted from now."""
        if self.deadline is None:
            self.deadline = time.monotonic() + grace_s
        stop.set()
        self.wake.set()

    def run(self, stop: threading.Event, *, grace_s: float) -> None:
        """Persist until ``stop``; then finish what is staged within ``grace_s``."""
        try:
            while not stop.is_set():
                if not self.run_once():
                    self.wake.wait(0.05)
                    self.wake.clear()
            if self.deadline is None:
                self.deadline = time.monotonic() + grace_s
            while self.run_once():
                pass
        except UploadAborted:
            log.warning(
                "shutdown grace of %.1fs ran out; staged checkpoints left uncommitted", grace_s
            )
