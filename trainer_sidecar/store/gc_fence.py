"""The gc fence: a save never names a chunk that a gc run deletes.

gc decides from what it listed, and each of its deletes lands whenever the store gets to
it, up to the moment gc finishes. A save in between may store again a chunk that gc found
old and unnamed (a constant tensor that came back), and commit: no check gc makes before
its delete can see that, and no check the save makes before the delete lands can either.
So gc runs and saves leave each other markers (docs/format.md, "The gc fence", states the
rules G1-G3 and S1-S4 this module implements):

    gc/<run>/sweep        G1: every chunk and rank manifest the run may delete, stored
                          before it reads the holds and before its first delete
    holds/<save>.<rank>   S2: every chunk a save's rank names, stored before that save
                          reads the runs; G2: a run deletes nothing a hold younger than
                          the grace names
    gc/<run>/done         G3: written once every delete was acknowledged; a run sends no
                          delete later than BUDGET_S after its sweep

A save lists ``gc/`` before it stores anything (S1): runs done by then cannot delete what
it stores later. Once its chunks are stored, before anything names them, it writes its
hold (S2) and reads every other run (S3). A run that has not swept yet will see the hold
(its sweep, then its read of the holds, both come later). A run that has swept may not
have: where its sweep names one of the save's chunks, the save waits for the run's end
and stores that chunk again (S4), then looks once more (another run may have listed the
chunk before it was deleted). The hold goes once the part naming the chunks is stored.

A run that crashed never writes ``done``: once its sweep is older than
BUDGET_S + DELIVERY_S on the store's clock it is *dead*, and every delete it sent has
landed. A save waits for a live run only when its sweep names one of the save's chunks.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import secrets
import time
from collections.abc import Callable, Collection, Iterable

from ..errors import CheckpointError, ObjectNotFound, StoreUnavailable
from .base import ObjectInfo, ObjectStore, read_bounded

log = logging.getLogger(__name__)

MARKERS = "gc/"
HOLDS = "holds/"
CLOCK_KEY = "clock"
BUDGET_S = 300.0
"""A gc run sends no delete later than this after its sweep (it stops instead)."""
DELIVERY_S = 60.0
"""A delete request sent lands within this long, or never (the fence's one assumption
about the network: it is what lets a crashed run count as over)."""
MAX_MARKER_BYTES = 256 << 20
"""The largest sweep or hold read (a sweep of a million keys is ~80 MiB): more is refused
unread, like a manifest past its limit (docs/format.md, Limits)."""
MAX_ROUNDS = 8
"""Rounds of S2-S4 before a save gives up (each round follows a run that deleted one of
its chunks; more than a few means gc runs back to back with a grace shorter than a save)."""


class Phase(enum.StrEnum):
    """How far a gc run got: each phase is one marker object, written in this order."""

    SWEEPING = "sweep"
    DONE = "done"


_ORDER = tuple(Phase)
_NAMES = frozenset(p.value for p in Phase)


@dataclasses.dataclass(frozen=True, slots=True)
class RunState:
    run: str
    phase: Phase  # the furthest marker present
    swept: float  # when its sweep was stored, on the store's clock
    keys: tuple[str, ...]  # its marker objects

    def dead(self, now: float) -> bool:
        """Crashed (or cut off by its budget) long enough ago that nothing it sent is
        still on the way."""
        return self.phase is not Phase.DONE and now - self.swept > BUDGET_S + DELIVERY_S

    def over(self, now: float) -> bool:
        return self.phase is Phase.DONE or self.dead(now)


def marker_key(run: str, phase: Phase) -> str:
    return f"{MARKERS}{run}/{phase.value}"


def hold_key(owner: str) -> str:
    return f"{HOLDS}{owner}.json"


def runs_in(listing: Iterable[ObjectInfo]) -> dict[str, RunState]:
    """Every gc run a listing of ``gc/`` shows, at its furthest phase (pure)."""
    seen: dict[str, dict[Phase, ObjectInfo]] = {}
    for info in listing:
        run, _, name = info.key.removeprefix(MARKERS).partition("/")
        if not info.key.startswith(MARKERS) or name not in _NAMES:
            continue  # not a marker: left alone
        seen.setdefault(run, {})[Phase(name)] = info
    return {
        run: RunState(
            run,
            max(phases, key=_ORDER.index),
            min(i.last_modified for i in phases.values()),
            tuple(sorted(i.key for i in phases.values())),
        )
        for run, phases in seen.items()
    }


def forgettable(runs: Iterable[RunState], *, now: float, grace_s: float) -> list[str]:
    """Marker objects of runs over for longer than any save may take (twice the grace):
    no save still in flight needs to read them (pure)."""
    keep_s = 2 * grace_s + BUDGET_S + DELIVERY_S
    return [k for r in runs if r.over(now) and now - r.swept > keep_s for k in r.keys]


def keys_body(keys: Iterable[str]) -> bytes:
    return json.dumps({"keys": sorted(keys)}, separators=(",", ":")).encode()


def read_keys(store: ObjectStore, key: str, what: str) -> frozenset[str]:
    """A sweep's or a hold's keys, read no further than MAX_MARKER_BYTES."""
    data = read_bounded(store, key, MAX_MARKER_BYTES)
    if len(data) > MAX_MARKER_BYTES:
        raise CheckpointError(f"{what} is larger than {MAX_MARKER_BYTES} bytes")
    return parse_keys(data, what)


def parse_keys(data: bytes, what: str) -> frozenset[str]:
    try:
        keys = json.loads(data)["keys"]
        if isinstance(keys, list) and all(isinstance(k, str) for k in keys):
            return frozenset(keys)
    except (ValueError, KeyError, TypeError, RecursionError):
        pass
    raise CheckpointError(f"{what} is unreadable")


def store_now(store: ObjectStore) -> float:
    """The store's own clock (object ages are on it), read by writing a tiny object."""
    store.put(CLOCK_KEY, b"")
    for info in store.list(CLOCK_KEY):
        if info.key == CLOCK_KEY:
            return info.last_modified
    return time.time()


class GcBudgetExceeded(CheckpointError):
    """A gc run reached its budget before it had sent every delete; it sent no more."""


class GcRun:
    """A gc run's side of the fence (G1-G3)."""

    def __init__(self, store: ObjectStore, *, clock: Callable[[], float] = time.monotonic):
        self._store = store
        self._clock = clock
        self.run = f"{time.time_ns():x}-{secrets.token_hex(4)}"
        self._swept_at: float | None = None
        self.deleted: list[str] = []

    def sweep(
        self, doomed: Iterable[str], *, now: float, grace_s: float, batch: int = 1000
    ) -> list[str]:
        """Publish what may go (G1), spare what a hold names (G2), delete the rest in
        batches while within the budget; what was deleted."""
        keys = sorted(doomed)
        self._swept_at = self._clock()  # before the write: the budget errs short
        self._store.put(marker_key(self.run, Phase.SWEEPING), keys_body(keys))
        held, stale_holds = self._holds(now=now, grace_s=grace_s)
        spared = [k for k in keys if k in held]
        if spared:
            log.info("gc: sparing %d object(s) a save in flight holds", len(spared))
        keys = [k for k in keys if k not in held]
        for i in range(0, len(keys), batch):
            self._within_budget(len(keys))
            self._store.delete(keys[i : i + batch])
            self.deleted += keys[i : i + batch]
        self.delete_unfenced(stale_holds)
        return self.deleted

    def _holds(self, *, now: float, grace_s: float) -> tuple[set[str], list[str]]:
        """What the holds of saves in flight name, and the holds past the grace, as old as
        a save's uploads gc deletes anyway (their saves are gone: a save that stores its
        part drops its hold a moment after it wrote it)."""
        held: set[str] = set()
        stale = []
        for info in self._store.list(HOLDS):
            if now - info.last_modified >= grace_s:
                stale.append(info.key)
                continue
            try:
                held |= read_keys(self._store, info.key, f"hold {info.key}")
            except ObjectNotFound:
                continue  # dropped meanwhile: its part names the chunks now
            except CheckpointError as exc:  # never ours: whoever wrote it holds nothing
                log.warning("gc: %s; it holds nothing", exc)
        return held, stale

    def delete_unfenced(self, keys: list[str]) -> None:
        """Objects no save stores again (parts, retired manifests, markers): no sweep."""
        if keys:
            self._within_budget(len(keys))
            self._store.delete(keys)

    def done(self) -> None:
        self._store.put(marker_key(self.run, Phase.DONE), b"")

    def _within_budget(self, total: int) -> None:
        if self._swept_at is not None and self._clock() - self._swept_at >= BUDGET_S:
            raise GcBudgetExceeded(
                f"gc run {self.run} reached its {BUDGET_S:.0f}s budget after deleting "
                f"{len(self.deleted)} of {total} objects; the next run deletes the rest"
            )


class SaveFence:
    """One rank's save's side of the fence: open it (S1) before storing anything,
    ``settle`` (S2-S4) once every chunk is stored and before anything names them,
    ``release`` once the part names them."""

    def __init__(
        self,
        store: ObjectStore,
        owner: str,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.05,
        max_poll_s: float = 0.5,
    ) -> None:
        self._store = store
        self._hold = hold_key(owner)
        self._sleep = sleep
        self._clock = clock
        self._poll_s = poll_s
        self._max_poll_s = max_poll_s
        self._store_clock: tuple[float, float] | None = None  # (store's now, our clock then)
        self._settled = {
            r.run for r in runs_in(store.list(MARKERS)).values() if r.phase is Phase.DONE
        }

    def settle(
        self, names: Callable[[], Collection[str]], store_again: Callable[[set[str]], None]
    ) -> None:
        """Return once no gc run can delete what ``names()`` holds, having stored again
        (``store_again``) whatever a run deleted."""
        for _ in range(MAX_ROUNDS):
            named = set(names())
            self._store.put(self._hold, keys_body(named))  # S2
            runs = runs_in(self._store.list(MARKERS)).values()
            lost: set[str] = set()
            for run in [r for r in runs if r.run not in self._settled]:  # S3
                hit = self._swept_by(run) & named
                if hit:
                    self._await_end(run)
                    lost |= hit
                self._settled.add(run.run)
            if not lost:
                return
            log.warning(
                "gc deleted %d chunk(s) this save had stored (it found them old and unnamed "
                "before this save stored them again): storing them once more",
                len(lost),
            )
            store_again(lost)  # S4
        raise CheckpointError(
            f"gc runs deleted this save's chunks {MAX_ROUNDS} times over: not naming them; "
            "is gc running back to back with a grace shorter than a save?"
        )

    def release(self) -> None:
        """The part names the chunks now (gc marks what a part names): drop the hold."""
        self._store.delete([self._hold])

    def _swept_by(self, run: RunState) -> frozenset[str]:
        try:
            key = marker_key(run.run, Phase.SWEEPING)
            return read_keys(self._store, key, f"gc run {run.run}'s sweep")
        except ObjectNotFound:  # forgotten meanwhile: over long ago
            return frozenset()
        except StoreUnavailable:  # unread is not empty: the save settles again, or fails
            raise
        except CheckpointError as exc:  # ours are never unreadable; someone else's may be
            log.warning("%s: assuming it deleted nothing", exc)
            return frozenset()

    def _await_end(self, run: RunState) -> None:
        """Until the run is done or dead (its markers gone: forgotten, over long ago)."""
        delay = self._poll_s
        state: RunState | None = run
        told = False
        while state is not None and state.phase is not Phase.DONE and not state.dead(self._now()):
            if not told:
                log.info(
                    "waiting for gc run %s to finish deleting before naming its chunks", run.run
                )
                told = True
            self._sleep(delay)
            delay = min(delay * 2, self._max_poll_s)
            state = runs_in(self._store.list(f"{MARKERS}{run.run}/")).get(run.run)

    def _now(self) -> float:
        """The store's clock now: read once (a write), then carried on by ours."""
        if self._store_clock is None:
            self._store_clock = (store_now(self._store), self._clock())
        then, ours = self._store_clock
        return then + (self._clock() - ours)
