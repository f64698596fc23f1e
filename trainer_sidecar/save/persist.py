"""The persister: turns staged checkpoints into committed ones.

For each staged slot (oldest first): upload this rank's part under the save's
identity (uploader.py), and on rank 0 wait for every rank's part of that save
and commit the manifest (store/commit.py), then apply retention. It runs in the
sidecar process (sidecar.py) or on a thread of the training process
(checkpointer.py), identically, and imports no torch. It must never run torch code:
CPython 3.11 ends a daemon thread at interpreter exit with pthread_exit, and a thread
inside a torch op then aborts the process (a finished trainer becomes a Failed pod).

A slot is freed when the persister is done with it: other ranks' once their
part is stored, rank 0's only once the commit is decided. So a sidecar killed
after every part was stored still holds rank 0's slot at its next start, and
commits then (or finds that its first commit had landed).

A store that is unavailable (``StoreUnavailable``: one request's retries spent) delays
the save instead of failing it: the upload and the commit are tried again until the
store answers, within the save's commit timeout (``_patiently``). A store gone for
seconds (its pod restarted, a network blip) costs that save seconds, not the save; and
a rank that gave up meanwhile could not tell the committer (its failure marker is
stored in the same store), which would wait out its commit timeout while the training
loop waited for the slot.

A rank whose upload fails for another reason, and a commit that fails, leave a
``.failed`` marker under the save: the committer stops waiting for that save at once,
and every rank's ``PendingSave.result()`` learns it within a poll.

Stopping: ``run(stop)`` returns once ``stop`` is set and nothing is staged. A
shutdown with a deadline (SIGTERM grace) finishes what is staged if it can;
past the deadline the upload is abandoned before any commit, so a partial
checkpoint is never visible.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..config import CheckpointConfig
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    SaveFailed,
    StoreUnavailable,
    UploadAborted,
)
from ..format.manifest import ChunkRef, Manifest, SaveIdentity
from ..format.policy import Committed, gc_due, reference_ranks
from ..metrics import CheckpointMetrics
from ..store import commit as commits
from ..store import repository
from ..store.base import ObjectStore
from ..store.chunk_cache import NodeChunks
from ..store.gc_fence import SaveFence
from . import slots
from .uploader import StagedFile, UploadSettings, upload_rank

log = logging.getLogger("ctj.persist")
T = TypeVar("T")
STORE_RETRY_CAP_S = 5.0  # the longest wait between two tries of an unavailable store

Watched = tuple[int, SaveIdentity, int]  # step, save, rank


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
        cache: NodeChunks | None = None,
        on_stored: Callable[[int, SaveIdentity], None] | None = None,
    ) -> None:
        """``on_stored(step, save)``: this persister stored its rank's part of that save
        (the sidecar's peer replication then waits for its commit)."""
        self.store = store
        self.cache = cache  # the node-local chunk cache the uploads fill (None: off)
        self.on_stored = on_stored
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
        self.started_at = time.time()
        self._reference_cache: tuple[tuple[int, int, int], dict[str, ChunkRef]] | None = None
        self._reference_read: Manifest | None = None
        self._watchers: dict[Watched, cf.Future[Manifest | None]] = {}
        self._lock = threading.Lock()
        self._latest: Manifest | None = None
        self._gc_owed = False  # retention retired something that gc has not swept since
        self._gc_ran_at: float | None = None  # monotonic, the last gc run that completed
        self._ended_attempt: int | None = None  # the newest attempt the operator ended

    # -- in-process completion: futures, no polling -----------------------------

    def watch(self, step: int, save: SaveIdentity, rank: int) -> cf.Future[Manifest | None]:
        """A future of this rank's part of the save: the manifest once rank 0 committed
        it, None once another rank's part is stored; the SaveFailed if it failed.
        Register before marking the slot ready."""
        fut: cf.Future[Manifest | None] = cf.Future()
        with self._lock:
            self._watchers[(step, save, rank)] = fut
        return fut

    def _resolve(
        self, staged: slots.StagedCheckpoint, result: Manifest | SaveFailed | None
    ) -> None:
        with self._lock:
            fut = self._watchers.pop((staged.step, staged.save, staged.rank), None)
        if fut is None or fut.done():
            return
        if isinstance(result, SaveFailed):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def latest_committed(self) -> Manifest | None:
        """The newest checkpoint this persister committed or found committed (at start-up,
        or a save decided before a restart); None before any. Read by other threads (the
        sidecar's heartbeat reports it), so nobody re-reads the store for it."""
        return self._latest

    def _committed(self, manifest: Manifest) -> None:
        with self._lock:
            previous = self._latest
            if previous is None or manifest.step >= previous.step:
                self._latest = manifest
        if previous is not None and manifest.step > previous.step:
            # the cadence the job commits at, which the stale-checkpoint alert compares with
            self.metrics.interval.set(max(0.0, manifest.created - previous.created))

    # -- one staged checkpoint ------------------------------------------------

    def attempt_ended(self, attempt: int) -> None:
        """The operator ended this pod's attempt ``attempt`` (it said so in its heartbeat):
        a commit of that attempt (or an older one) still waiting for other ranks' parts
        stops waiting, since those ranks are being torn down, restarted in place or were
        lost with their node (a commit that waited would hold the pod, and so the next
        attempt, for the rest of the shutdown grace). This rank's own uploads go on, and a
        save of a newer attempt (the pod's worker restarted in place) commits as usual."""
        with self._lock:
            if self._ended_attempt is None or attempt > self._ended_attempt:
                self._ended_attempt = attempt

    def _attempt_over(self, save: SaveIdentity) -> bool:
        """Whether ``save`` belongs to an attempt the operator ended. A save whose attempt
        is not a number (not the operator's CTJ_ATTEMPT) is over once any attempt is."""
        ended = self._ended_attempt
        if ended is None:
            return False
        attempt = save.attempt
        return not attempt.isdigit() or int(attempt) <= ended

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _reference_chunks(self, staged: slots.StagedCheckpoint) -> dict[str, ChunkRef]:
        """What this rank's upload need not send: the reference checkpoint's chunks of the
        ranks ``reference_ranks`` picks (version 3: only those ranks' rank manifests are
        read; versions 1 and 2 hold every chunk list inline, so all of it)."""
        step = staged.plan.reference_step
        if step is None:
            return {}
        key = (step, staged.rank, staged.world_size)
        if self._reference_cache and self._reference_cache[0] == key:
            return self._reference_cache[1]
        try:
            manifest = self._reference_manifest(step)
            ranks = (
                reference_ranks(staged.rank, staged.world_size, manifest.world_size)
                if manifest.ranks
                else range(1)  # versions 1 and 2: every chunk list is inline, one read
            )
            files = [entry for r in ranks for entry in manifest.rank_files(r).values()]
            chunks = {c.id: c for f in files for c in f.chunks}
        except NoCheckpointError:
            log.warning("reference checkpoint %d is gone: uploading every chunk", step)
            chunks = {}
        except CorruptCheckpointError as exc:  # uploading more is never wrong
            log.warning("reference checkpoint %d: %s; uploading every chunk", step, exc)
            chunks = {}
        self._reference_cache = (key, chunks)
        return chunks

    def _reference_manifest(self, step: int) -> Manifest:
        """The reference's manifest, read once per reference (a sidecar serving several
        ranks reads it once for all of them, and each rank manifest once)."""
        if self._reference_read is None or self._reference_read.step != step:
            self._reference_read = repository.read_manifest(self.store, step, retired_too=True)
        return self._reference_read

    def upload(self, slot: Path, staged: slots.StagedCheckpoint) -> None:
        """Upload one rank's staged checkpoint and store its part."""
        started = time.monotonic()
        log.info("uploading step %d (rank %d, %s)", staged.step, staged.rank, staged.save)
        files = [StagedFile(name, str(slot / name), items) for name, items in staged.files]
        # before anything is stored (gc_fence.py, S1), once: a second try keeps it (its hold
        # is in place from the first try's S2 on); the hold is this rank's of this save
        owner = f"{staged.step}-{staged.save.key}-{staged.rank}"
        fence = self._patiently(staged, "upload", lambda _: SaveFence(self.store, owner))
        part = self._patiently(
            staged,
            "upload",
            lambda _: upload_rank(
                self.store,
                step=staged.step,
                rank=staged.rank,
                save=staged.save,
                world_size=staged.world_size,
                files=files,
                reference=self._reference_chunks(staged),
                settings=self.settings,
                should_stop=self._past_deadline,
                cache=self.cache,
                fence=fence,
            ),
        )
        self.metrics.observe_upload(time.monotonic() - started, staged.rank)
        self.metrics.bytes.labels(kind="uploaded").inc(part.uploaded_bytes)
        self.metrics.bytes.labels(kind="deduplicated").inc(part.deduplicated_bytes)
        log.info(
            "rank %d uploaded step %d: %d bytes sent, %d deduplicated",
            staged.rank,
            staged.step,
            part.uploaded_bytes,
            part.deduplicated_bytes,
        )
        if self.on_stored is not None:
            self.on_stored(staged.step, staged.save)

    def commit(self, staged: slots.StagedCheckpoint) -> Manifest:
        """Rank 0's job: once every rank's part of this save is stored, write the manifest."""
        self._wait_for_parts(staged)
        if self._past_deadline():
            raise UploadAborted(f"step {staged.step}: shutdown grace ran out before the commit")
        manifest = self._patiently(staged, "commit", lambda n: self._commit_once(staged, n))
        slots.write_state(self.root, Committed.of(manifest), self.config.uri)
        self._committed(manifest)
        self.metrics.commit.observe(max(0.0, time.time() - staged.staged_at))
        self.metrics.bytes.labels(kind="logical").inc(manifest.logical_bytes)
        self.metrics.last_success.set(manifest.created)
        self.metrics.last_step.set(manifest.step)
        log.info(
            "committed step %d (%s, %d bytes uploaded of %d; %s)",
            manifest.step,
            manifest.mode,
            manifest.uploaded_bytes,
            manifest.logical_bytes,
            staged.save,
        )
        self._retention(manifest.step)
        return manifest

    def _commit_once(self, staged: slots.StagedCheckpoint, attempt: int) -> Manifest:
        """Write the manifest. A try after the first (the store was unavailable) first asks
        whether an earlier one had committed: its parts are deleted once it has."""
        if attempt > 1:
            decided = commits.outcome(self.store, staged.step, staged.save)
            if isinstance(decided, Manifest):
                return decided
            if isinstance(decided, SaveFailed):
                raise decided
        return commits.commit(
            self.store,
            staged.plan,
            world_size=staged.world_size,
            block_size=self.config.block_size,
            timings={"stage": staged.stage_seconds, "persist": time.time() - staged.staged_at},
            versions=self.versions,
        )

    def _patiently(
        self, staged: slots.StagedCheckpoint, stage: str, call: Callable[[int], T]
    ) -> T:
        """``call(attempt)`` (from 1), tried again while the store is unavailable, until the
        save's commit timeout (counted from its staging), the shutdown deadline or its
        attempt's end; then the last StoreUnavailable (see the module's docstring). Each
        try the store did not answer counts as a failure at ``stage`` (upload, commit):
        the failure alert fires for a store that is down while the save waits for it."""
        give_up = staged.staged_at + self.config.commit_timeout_s
        delay = 0.5
        attempt = 1
        while True:
            try:
                return call(attempt)
            except StoreUnavailable as exc:
                if (
                    time.time() + delay >= give_up
                    or self._past_deadline()
                    or self._attempt_over(staged.save)
                ):
                    raise
                self.metrics.count_failure(stage)
                log.warning(
                    "step %d (rank %d): %s; the %s is tried again in %.1fs",
                    staged.step, staged.rank, exc, stage, delay,
                )  # fmt: skip
                time.sleep(delay)
                delay = min(delay * 2, STORE_RETRY_CAP_S)
                attempt += 1

    def _wait_for_parts(self, staged: slots.StagedCheckpoint) -> None:
        """Poll the save's parts: until all are there, one says it failed, or the commit
        timeout passes. Meanwhile the other ranks this persister serves are uploaded as
        they are staged: a sidecar serves every rank of its pod (nprocPerNode), and the
        part rank 0's commit waits for may be one only it can upload, staged after
        ``run_once`` looked (a rank that staged later than rank 0 would otherwise wait
        for the commit timeout, and the save fail)."""
        give_up = time.monotonic() + self.config.commit_timeout_s
        delay = 0.01
        while True:
            if self._upload_other_ranks():
                delay = 0.01
            try:
                state = commits.progress(self.store, staged.step, staged.save)
            except StoreUnavailable as exc:  # the parts may be on their way: ask again
                self.metrics.count_failure("commit")
                log.warning("step %d: %s; asking again", staged.step, exc)
                state = commits.Progress(ranks=frozenset(), failed=())  # nothing known
            if state.failed:
                why = commits.failure_reasons(self.store, staged.step, staged.save, state.failed)
                raise SaveFailed(f"step {staged.step}: not committing, {why}")
            if len(state.ranks) >= staged.world_size:
                return
            if self._attempt_over(staged.save):
                raise SaveFailed(
                    f"step {staged.step}: the attempt ended (the operator said so in its "
                    f"heartbeat) with {len(state.ranks)} of {staged.world_size} ranks "
                    "uploaded; not committing"
                )
            if time.monotonic() >= give_up or self._past_deadline():
                raise SaveFailed(
                    f"step {staged.step}: only {len(state.ranks)} of {staged.world_size} ranks "
                    f"uploaded within {self.config.commit_timeout_s:.0f}s; not committing"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _upload_other_ranks(self) -> bool:
        """Upload every slot staged now by a rank other than 0 that this persister serves
        (none in process mode: it serves its own rank); True if there was one."""
        if self.rank is not None:
            return False
        others = [(slot, s) for slot, s in slots.pending(self.root) if s.rank != 0]
        for slot, staged in others:
            if self._upload_or_report(slot, staged):
                self._finish(slot, staged, None)
        return bool(others)

    def _retention(self, step: int) -> None:
        """Retire past keep_last; then gc, if this or an earlier commit retired something
        and a run is due (policy.gc_due: not after every commit of a frequent saver)."""
        try:
            if repository.apply_retention(self.store, self.config.keep_last):
                self._gc_owed = True
            now = time.monotonic()
            if self._gc_owed and gc_due(self._gc_ran_at, now, self.config.gc_grace_s):
                repository.collect_garbage(self.store, grace_s=self.config.gc_grace_s)
                self._gc_owed, self._gc_ran_at = False, now
        except CheckpointError as exc:  # housekeeping; the commit stands
            log.error("retention or gc after step %d stopped: %s", step, exc)
            self.metrics.gc_blocked.set(1)
            self._gc_ran_at = None  # due again at the next commit
        except Exception:  # noqa: BLE001 - the same, unforeseen: with its traceback
            log.exception("retention or gc after step %d failed", step)
            self.metrics.gc_blocked.set(1)
            self._gc_ran_at = None
        else:
            self.metrics.gc_blocked.set(0)

    def _recovered(self, staged: slots.StagedCheckpoint) -> Manifest | SaveFailed | None:
        """For rank 0's slot staged before this persister started (a restart): what had
        become of its save (committed, or failed for good), None if still to commit."""
        if staged.staged_at >= self.started_at:
            return None
        return commits.outcome(self.store, staged.step, staged.save)

    # -- the loop ------------------------------------------------------------------

    def publish_latest(self) -> None:
        """Tell the trainer (state.json) what the store's latest commit is, at start-up."""
        latest = repository.latest_manifest(self.store)
        if latest is not None:
            slots.write_state(self.root, Committed.of(latest), self.config.uri)
            self._committed(latest)

    def run_once(self) -> bool:
        """Persist everything staged now; False if there was nothing to do.

        Every staged rank is uploaded before any commit is attempted: one sidecar
        may serve several ranks of a step (nprocPerNode > 1), rank 0 among them.
        """
        if self.rank is None:  # a sidecar: export what the trainers observed
            for observation in slots.take_observations(self.root):
                self.metrics.apply(*observation)
        work = slots.pending(self.root, self.rank)
        to_commit = []
        for slot, staged in work:
            if staged.rank == 0 and (decided := self._recovered(staged)) is not None:
                what = "committed" if isinstance(decided, Manifest) else str(decided)
                if isinstance(decided, Manifest):
                    self._committed(decided)
                log.info("step %d had been decided before a restart: %s", staged.step, what)
                self._finish(slot, staged, decided)
                continue
            if not self._upload_or_report(slot, staged):
                continue
            if staged.rank == 0:
                to_commit.append((slot, staged))  # its slot stays until the commit is decided
            else:
                self._finish(slot, staged, None)
        for slot, staged in to_commit:
            try:
                manifest = self.commit(staged)
            except UploadAborted:
                self.metrics.count_failure("commit")
                raise  # the slot stays staged for the next start
            except Exception as exc:  # noqa: BLE001 - counted, logged, told; the job trains on
                self._fail(slot, staged, "commit", exc)
                continue
            self._finish(slot, staged, manifest)
        return bool(work)

    def _upload_or_report(self, slot: Path, staged: slots.StagedCheckpoint) -> bool:
        if staged.staged_at < self.started_at and commits.has_part(
            self.store, staged.step, staged.save, staged.rank
        ):
            return True  # stored before a restart: nothing to redo
        try:
            self.upload(slot, staged)
            return True
        except UploadAborted as exc:
            log.warning("%s", exc)
            self.metrics.count_failure("upload")
            raise
        except Exception as exc:  # noqa: BLE001 - counted, logged, told; the job trains on
            self._fail(slot, staged, "upload", exc)
            return False

    def _fail(
        self, slot: Path, staged: slots.StagedCheckpoint, stage: str, exc: BaseException
    ) -> None:
        self.metrics.count_failure(stage)
        who = "commit" if stage == "commit" else f"rank-{staged.rank}"
        commits.report_failure(self.store, staged.step, staged.save, who, str(exc))
        log.error("step %d (rank %d) not persisted: %s", staged.step, staged.rank, exc)
        failure = (
            exc
            if isinstance(exc, SaveFailed)
            else SaveFailed(f"save of step {staged.step} failed at {stage}: {exc}")
        )
        self._finish(slot, staged, failure)

    def _finish(
        self, slot: Path, staged: slots.StagedCheckpoint, result: Manifest | SaveFailed | None
    ) -> None:
        slots.release(slot)
        self._resolve(staged, result)

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
        except CheckpointError:
            log.exception("the persister stopped")
            raise
