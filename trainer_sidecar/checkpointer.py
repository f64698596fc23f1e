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

The path of a save, top down: ``Checkpointer.save`` → ``save.protocol`` (slot,
exchange, copy) → ``save.persist`` (upload, fenced commit) → ``store``.
A load: ``Checkpointer.load`` → ``load.restore`` → ``load`` readers → ``store``.

``extra`` is a dict of plain values saved once (replicated: rank 0's values win
DCP's deduplication) and loaded into every rank.

One location holds one run, its steps in order: the first save refuses a step below
the checkpoints already there (``start_refusal``), since a restart would resume from
those, not from this run. Resume with ``load()``, use a new URI for a new run, or
remove the later checkpoints to go back on purpose.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import dataclasses
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from . import __version__, collectives
from .config import CheckpointConfig, job_staging_dir
from .errors import CheckpointError, SaveFailed, StoreUnavailable
from .format.manifest import Manifest, SaveIdentity
from .liveness import Pulse
from .load import resume
from .load.restore import LoadResult, RestoreSettings, restore
from .metrics import CheckpointMetrics, serve
from .parts import Parts
from .save import slots, staging
from .save.persist import Persister
from .save.protocol import SaveProtocol
from .state_dict import build_state
from .store import commit as commits
from .store import repository
from .store.base import ObjectStore

log = logging.getLogger("ctj.checkpoint")
DONE_POLL_S = 0.5  # PendingSave.done(): the store is asked at most this often per save

__all__ = ["Checkpointer", "LoadResult", "PendingSave", "SaveResult"]


@dataclasses.dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    mode: str
    logical_bytes: int
    uploaded_bytes: int
    deduplicated_bytes: int
    stage_seconds: float  # how long save() blocked the training loop
    total_seconds: float  # from save() to the commit being visible


class PendingSave:
    """A staged save. ``result()`` blocks until its checkpoint is committed.

    In-process, rank 0's persister resolves a future when it commits; every other
    case (another rank's commit, a sidecar's) is another process, and the store's
    answer (``commit.outcome``: this save's manifest, or a failure marker) is polled.
    """

    def __init__(
        self,
        store: ObjectStore,
        staged: slots.StagedCheckpoint,
        *,
        started: float,
        replanned: bool,
        completion: cf.Future[Manifest | None] | None,
        default_timeout_s: float,
    ) -> None:
        self.store = store
        self.step = staged.step
        self.save: SaveIdentity = staged.save
        self.stage_seconds = staged.stage_seconds
        self.replanned = replanned  # DCP planned it (first save, or a rank's layout changed)
        self._started = started
        self._completion = completion
        self._default_timeout_s = default_timeout_s
        self._result: SaveResult | None = None
        self._next_poll = 0.0  # monotonic: done() asks the store again no sooner

    def done(self) -> bool:
        """True once the save is committed or has failed (a non-blocking check).

        Where the answer is another process's (a sidecar's commit, rank 0's for other
        ranks), it is the store's, asked at most every ``DONE_POLL_S``: a loop that asks
        at every step would otherwise send a few requests per step per rank (the test
        tiers' trainers did, at five steps a second). False while the store does not
        answer: a training loop that asks is not ended by an outage the persister rides
        out (it tries the save again until the store is back)."""
        if self._result is not None:
            return True
        if self._completion is not None and self._completion.done():
            if self._completion.exception() is not None or self._completion.result() is not None:
                return True
        now = time.monotonic()
        if now < self._next_poll:
            return False
        self._next_poll = now + DONE_POLL_S
        try:
            return commits.outcome(self.store, self.step, self.save) is not None
        except StoreUnavailable:
            return False

    def result(self, timeout: float | None = None) -> SaveResult:
        """The committed checkpoint's figures; raises SaveFailed (a CheckpointError) if
        the save failed or lost to another save, CheckpointError on timeout."""
        if self._result is not None:
            return self._result
        limit = self._default_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        manifest: Manifest | None = None
        if self._completion is not None:
            try:
                manifest = self._completion.result(timeout=limit)
            except cf.TimeoutError:
                raise self._timed_out(limit) from None
        if manifest is None:
            manifest = self._poll(deadline, limit)
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

    def _poll(self, deadline: float, limit: float) -> Manifest:
        delay = 0.005
        while True:
            try:
                found = commits.outcome(self.store, self.step, self.save)
            except StoreUnavailable as exc:  # waited out until the deadline, as in the persister
                if time.monotonic() >= deadline:
                    raise
                log.warning("step %d: %s; asking again", self.step, exc)
                found = None
            if isinstance(found, SaveFailed):
                raise found
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise self._timed_out(limit)
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _timed_out(self, limit: float) -> CheckpointError:
        return CheckpointError(
            f"step {self.step} was not committed within {limit:.0f}s "
            "(is the sidecar running? see its log)"
        )


def start_refusal(step: int, later: list[int], uri: str) -> str:
    """Why a first save at ``step`` is refused where ``later`` steps are committed, and the
    three ways on."""
    shown = ", ".join(map(str, later)) if len(later) <= 8 else f"{later[0]} to {later[-1]}"
    steps = " ".join(map(str, later)) if len(later) <= 8 else "<steps `ctj checkpoints ls` shows>"
    return (
        f"step {step} is below the checkpoints at {uri} (steps {shown}): a restart would "
        f"resume from those, not from this run. To resume, call load() before training and "
        f"go on from the step it restored; for a new run, use a new URI; "
        f"to go back to step {step} on purpose, remove the later ones first "
        f"(ctj checkpoints rm {uri} {steps})"
    )


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
        self._parts = Parts.open(config, store=store)
        self.store: ObjectStore = self._parts.store
        self.group = process_group
        self.rank = collectives.rank(process_group)
        self.root = job_staging_dir(config)
        self.metrics = metrics or CheckpointMetrics()
        if config.sidecar:  # this process serves no /metrics: the sidecar exports for it
            self.metrics.relay = functools.partial(slots.relay_observation, self.root, self.rank)
        self._preempted = False
        self._request_file = str(slots.request_path(self.root))  # the sidecar writes it
        self._lock = slots.RankLock(self.root, self.rank)
        self._opened = False
        self._persister: Persister | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._protocol = SaveProtocol(
            config=config,
            store=self.store,
            root=self.root,
            rank=self.rank,
            group=process_group,
            metrics=self.metrics,
        )
        self._last: PendingSave | None = None
        self._start_checked = False  # the first save found no later step (_check_start)
        self.cache = self._parts.cache
        self._server = (
            serve(config.metrics_port, self.metrics) if config.metrics_port is not None else None
        )
        self._pulse: Pulse | None = None
        if config.sidecar:  # the sidecar tells the operator this trainer still runs
            slots.prepare_root(self.root)
            self._pulse = Pulse(self.root, self.rank)
            atexit.register(self._stop_pulse)

    # -- save -------------------------------------------------------------------

    def _open(self) -> None:
        """On the first save: the private staging root, this rank's lock on it, and (in
        process mode) the thread that does a sidecar's job."""
        if self._opened:
            return
        slots.prepare_root(self.root)
        self._lock.acquire()
        self._opened = True
        atexit.register(self.close)
        if self.config.sidecar:
            return
        self._persister = self._parts.persister(
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
        previous save still uploading). Collective (see save/protocol.py).
        Until one passes, a save below the steps committed at this location raises
        CheckpointError (``start_refusal``: load first, or use a new URI).
        """
        started = time.monotonic()
        self._check_start(step)
        self._open()
        state = build_state(model, optimizer, extra)
        done = self._protocol.stage(step, state, started=started)
        if done is None:
            return None
        staged = done.staged
        completion = (
            self._persister.watch(staged.step, staged.save, staged.rank)
            if self._persister
            else None
        )
        slots.mark_ready(done.slot, staged)
        self.metrics.observe_stall(staged.stage_seconds, self.rank)
        # no wake-up for an in-process persister: it polls its slots (every 50 ms), and
        # waking it here would hand it the GIL before save() returns
        self._last = PendingSave(
            self.store,
            staged,
            started=started,
            replanned=done.replanned,
            completion=completion,
            default_timeout_s=self.config.commit_timeout_s * 2,
        )
        return self._last

    def _check_start(self, step: int) -> None:
        """Collective, until a save passes it: refuse a first save below the checkpoints
        at this location (rank 0 lists them; every rank raises the same error)."""
        if self._start_checked:
            return
        later = collectives.decided_by_rank0(functools.partial(self._steps_after, step), self.group)
        if later:
            raise CheckpointError(start_refusal(step, later, self.config.uri))
        self._start_checked = True

    def _steps_after(self, step: int) -> list[int]:
        try:
            return [s for s in repository.committed_steps(self.store) if s > step]
        except CheckpointError as exc:  # the save itself will say what is wrong with the store
            log.warning("could not list the checkpoints above step %d: %s", step, exc)
            return []

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is served on (config.metrics_port, or the one 0 picked)."""
        return int(self._server.server_address[1]) if self._server else None

    def preemption_requested(self) -> bool:
        """Collective: True on every rank once any rank got SIGTERM (see handle_sigterm) or
        its pod's sidecar received a checkpoint request from the operator (a planned
        resize; see checkpoint_request). For the training loop it means: save at this step
        boundary, wait for the commit (``result()``), and stop. Every rank must call it at
        the same step; each call costs one all-reduce and one ``os.path.exists``."""
        asked = self._preempted or os.path.exists(self._request_file)
        return collectives.any_rank(asked, self.group)

    def checkpoint_request(self) -> str | None:
        """The id of the operator's checkpoint request this pod's sidecar wrote into the
        staging root, or None. Local, not collective: ranks of other pods may see None
        while ``preemption_requested()`` is True on all of them."""
        return slots.read_request(self.root)

    def handle_sigterm(self) -> None:
        """On SIGTERM, only note it: the loop saves at the next step boundary and exits."""

        def note(signum: int, frame: Any) -> None:
            self._preempted = True

        signal.signal(signal.SIGTERM, note)

    def close(self, timeout: float | None = None, *, wait_for_commit: bool = True) -> None:
        """Flush: wait for the last save's commit (within the shutdown grace, or
        ``timeout``), in both modes; then stop the persister thread, free this rank's
        staging buffers (if nothing is left staged for a sidecar) and its lock.

        ``wait_for_commit=False`` is for a loop that failed (``__exit__`` on an exception):
        often a peer's death broke a collective, and the last save may never commit, so
        the trainer does not wait out the grace for it. Nothing is dropped: a sidecar owns
        what is staged and settles it, and an in-process persister still gets the grace to
        store this rank's part."""
        self._stop_pulse()
        if not self._opened:
            self._stop_server()
            return
        self._opened = False
        grace = self.config.shutdown_grace_s if timeout is None else timeout
        deadline = time.monotonic() + grace
        if self._last is not None and not wait_for_commit:
            log.info("close(): not waiting for step %d to commit", self._last.step)
        elif self._last is not None:
            try:
                self._last.result(timeout=grace)
            except CheckpointError as exc:
                log.warning("close(): the last save (step %d) failed: %s", self._last.step, exc)
        if self._thread is not None and self._persister is not None:
            self._persister.shutdown(self._stop, max(0.0, deadline - time.monotonic()))
            self._thread.join(max(0.0, deadline - time.monotonic()) + 5)
            if self._thread.is_alive():
                log.warning("close(): the persister is still busy after the grace; leaving it")
        if not slots.pending(self.root, self.rank):
            staging.remove_rank(self.root, self.rank)
        else:
            staging.unmap_rank(self.root, self.rank)
        self._lock.release()
        self._stop_server()
        atexit.unregister(self.close)

    def _stop_pulse(self) -> None:
        if self._pulse is not None:
            self._pulse.stop()
            self._pulse = None
            atexit.unregister(self._stop_pulse)

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(wait_for_commit=exc_type is None)

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

        Returns None when there is none. A checkpoint that is corrupt, unreadable or
        unsafe is skipped with a warning, and the previous one is tried.

        A run that loaded has resumed from what this location holds (the newest usable
        checkpoint, or the one it asked for): its saves are not refused for the steps
        above (a fallback past a corrupt newest one must still save).

        Where this location holds no committed checkpoint and ``config.resume_from`` is
        set (spec.checkpoint.resumeFrom), the run is seeded from the newest committed one
        there, read-only (load/resume.py; ``LoadResult.source`` says where from); its saves
        still go to its own location, so a later load finds its own checkpoints first. A
        source with nothing committed raises ``ResumeSourceError``, never a start from 0.
        """
        load = functools.partial(
            restore,
            model=model,
            optimizer=optimizer,
            extra=extra,
            step=step,
            settings=RestoreSettings(
                parallelism=self.config.parallelism,
                trust_pickled_values=self.config.trust_pickled_values,
            ),
            metrics=self.metrics,
            group=self.group,
            tiers=self._parts.tiers(),
        )
        result = load(self.store)
        if result is None and self.config.resume_from is not None:
            result = self._seed(load)
        self._start_checked = True  # resumed (collective: every rank got here)
        return result

    def _seed(self, load: Callable[[ObjectStore], LoadResult | None]) -> LoadResult:
        """Collective: load the resume source's newest usable commit (rank 0 resolves it)."""
        seed = collectives.decided_by_rank0(
            functools.partial(resume.resolve, self.config), self.group
        )
        result = load(resume.open_source(seed.uri, self.config))
        if result is None:  # its checkpoints went between the two looks (a `rm`, a gc)
            raise resume.ResumeSourceError(
                f"{resume.FIELD}: {seed.uri} had step {seed.step} committed, then none: "
                "was it removed meanwhile? Check it with `ctj checkpoints ls`"
            )
        passed = f" (newer than {', '.join(c.uri for c in seed.others)})" if seed.others else ""
        log.warning(
            "resumed from step %d of %s%s (%s); this job's own location %s had no checkpoint, "
            "and its saves go there",
            result.step,
            seed.uri,
            passed,
            resume.FIELD,
            self.config.uri,
        )
        return dataclasses.replace(result, source=seed.uri)
