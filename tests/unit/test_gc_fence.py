"""The gc fence's rules (store/gc_fence.py, docs/format.md "The gc fence"), on an
in-memory store whose clock the test moves: what a save waits for, what it stores again,
what a gc run spares, and what both may ignore."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from trainer_sidecar.errors import StoreUnavailable
from trainer_sidecar.store import gc_fence
from trainer_sidecar.store.gc_fence import (
    BUDGET_S,
    DELIVERY_S,
    GcBudgetExceeded,
    GcRun,
    Phase,
    SaveFence,
    keys_body,
    marker_key,
    runs_in,
)
from trainer_sidecar.store.memory import MemoryStore

CHUNK = "chunks/ab/abc"
OTHER = "chunks/cd/cde"


class Timeline:
    """A fake sleep: each call moves the store's clock and runs the next scripted step of
    a concurrent gc run."""

    def __init__(self, store: MemoryStore, *steps: Callable[[], object]) -> None:
        self.store = store
        self.steps = list(steps)
        self.slept = 0

    def sleep(self, seconds: float) -> None:
        self.slept += 1
        self.store.now += seconds
        if self.steps:
            self.steps.pop(0)()


def never(seconds: float) -> None:
    pytest.fail(f"the save waited ({seconds}s) where it had no reason to")


def settle(fence: SaveFence, names: set[str]) -> list[set[str]]:
    stored_again: list[set[str]] = []
    fence.settle(lambda: names, stored_again.append)
    return stored_again


def swept(store: MemoryStore, run: str, *keys: str) -> None:
    """A run has published its sweep; its deletes are on their way."""
    store.put(marker_key(run, Phase.SWEEPING), keys_body(keys))


def finish(store: MemoryStore, run: str, *deleted: str) -> None:
    """Its deletes land, then it writes done."""
    store.delete(deleted)
    store.put(marker_key(run, Phase.DONE), b"")


def test_runs_in_reads_each_runs_furthest_phase_and_ignores_other_keys() -> None:
    store = MemoryStore()
    swept(store, "a", CHUNK)
    store.now += 5
    store.put(marker_key("a", Phase.DONE), b"")
    swept(store, "b")
    store.put("gc/a/whatever", b"")
    store.put("gcx/b/done", b"")
    runs = runs_in(store.list("gc"))
    assert {r: (s.phase, s.swept) for r, s in runs.items()} == {
        "a": (Phase.DONE, 1_000_000.0),
        "b": (Phase.SWEEPING, 1_000_005.0),
    }


def test_a_run_done_before_the_save_opened_its_fence_is_not_followed() -> None:
    store = MemoryStore()
    swept(store, "a", CHUNK)
    finish(store, "a", CHUNK)
    fence = SaveFence(store, "s", sleep=never)
    store.put(CHUNK, b"stored after that run's delete landed")
    assert settle(fence, {CHUNK}) == []


def test_a_run_that_swept_the_saves_chunk_is_awaited_then_the_chunk_is_stored_again() -> None:
    store = MemoryStore()
    store.put(CHUNK, b"old and unnamed: the run dooms it")
    swept(store, "a", CHUNK)  # its delete of the chunk is on the way
    timeline = Timeline(store, lambda: finish(store, "a", CHUNK))
    fence = SaveFence(store, "s", sleep=timeline.sleep)
    store.put(CHUNK, b"the save stores it again")  # the delete has not landed yet
    assert settle(fence, {CHUNK, OTHER}) == [{CHUNK}]
    assert timeline.slept == 1  # stored again only after the run's end: after its delete
    assert CHUNK not in store.objects  # (this fake's store_again only records)


def test_a_run_that_sweeps_after_the_saves_hold_spares_its_chunks() -> None:
    store = MemoryStore()
    store.put(CHUNK, b"stored by the save")
    store.put(OTHER, b"old and unnamed")
    fence = SaveFence(store, "s", sleep=never)
    assert settle(fence, {CHUNK}) == []  # no run yet: the hold stays until release()
    run = GcRun(store)
    assert run.sweep([CHUNK, OTHER], now=store.now, grace_s=60) == [OTHER]
    assert CHUNK in store.objects and OTHER not in store.objects
    fence.release()
    assert not list(store.list(gc_fence.HOLDS))


class SweepUnreadable(MemoryStore):
    """The store down while the fence reads a run's sweep, once."""

    def __init__(self) -> None:
        super().__init__()
        self.outage = True

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        if self.outage and key == marker_key("a", Phase.SWEEPING):
            self.outage = False
            raise StoreUnavailable("the S3 endpoint is unreachable (a test's outage)")
        return super().get(key, byte_range=byte_range)


def test_a_sweep_unread_while_the_store_is_down_is_not_taken_as_empty() -> None:
    store = SweepUnreadable()
    store.put(CHUNK, b"old and unnamed: the run dooms it")
    swept(store, "a", CHUNK)
    timeline = Timeline(store, lambda: finish(store, "a", CHUNK))
    fence = SaveFence(store, "s", sleep=timeline.sleep)
    store.put(CHUNK, b"the save stores it again")
    with pytest.raises(StoreUnavailable):
        settle(fence, {CHUNK})
    # the store back, the save settles again: the run is still followed, not settled
    assert settle(fence, {CHUNK}) == [{CHUNK}]


def test_a_run_whose_sweep_names_none_of_the_saves_chunks_is_not_awaited() -> None:
    store = MemoryStore()
    swept(store, "a", OTHER)
    fence = SaveFence(store, "s", sleep=never)
    assert settle(fence, {CHUNK}) == []


def test_a_dead_run_is_not_awaited_but_its_deletes_count() -> None:
    store = MemoryStore()
    swept(store, "a", CHUNK)  # then it crashed: no done, ever
    fence = SaveFence(store, "s", sleep=never)
    store.now += BUDGET_S + DELIVERY_S + 1
    assert settle(fence, {CHUNK}) == [{CHUNK}]


def test_a_run_that_listed_before_another_runs_delete_landed_is_followed_too() -> None:
    """Run b listed while run a's delete was on its way: it found the chunk old too, and
    swept before the save's hold, so its delete can land after the save stored the chunk
    again. The save follows b as well."""
    store = MemoryStore()
    swept(store, "a", CHUNK)

    def a_ends_and_b_sweeps() -> None:
        finish(store, "a", CHUNK)
        swept(store, "b", CHUNK)

    timeline = Timeline(store, a_ends_and_b_sweeps, lambda: finish(store, "b", CHUNK))
    fence = SaveFence(store, "s", sleep=timeline.sleep)
    rounds: list[set[str]] = []

    def store_again(lost: set[str]) -> None:
        rounds.append(lost)
        store.put(CHUNK, b"stored again")

    fence.settle(lambda: {CHUNK}, store_again)
    assert rounds == [{CHUNK}, {CHUNK}]
    assert timeline.slept == 2


def test_a_save_gives_up_when_runs_keep_deleting_its_chunks() -> None:
    store = MemoryStore()
    fence = SaveFence(store, "s")
    count = iter(range(100))

    def another_run_deleted_it(lost: set[str]) -> None:
        run = f"r{next(count)}"
        swept(store, run, CHUNK)
        store.put(marker_key(run, Phase.DONE), b"")

    another_run_deleted_it(set())
    with pytest.raises(gc_fence.CheckpointError, match="8 times over"):
        fence.settle(lambda: {CHUNK}, another_run_deleted_it)


def test_a_run_reaching_its_budget_stops_deleting_and_is_never_done() -> None:
    store = MemoryStore()
    keys = [f"chunks/{i:02d}/{i}" for i in range(5)]
    for k in keys:
        store.put(k, b"x")
    now = [0.0]
    run = GcRun(store, clock=lambda: now[0])

    def delete(batch: Iterable[str]) -> None:
        MemoryStore.delete(store, batch)
        now[0] += BUDGET_S / 2

    store.delete = delete  # type: ignore[method-assign,assignment]  # a clock per batch
    with pytest.raises(GcBudgetExceeded, match="budget after deleting 4 of 5"):
        run.sweep(keys, now=store.now, grace_s=60, batch=2)
    assert [k for k in keys if k in store.objects] == keys[4:]
    assert runs_in(store.list("gc/"))[run.run].phase is Phase.SWEEPING


def test_a_hold_past_the_grace_is_dropped_and_spares_nothing() -> None:
    store = MemoryStore()
    store.put(CHUNK, b"x")
    store.put(gc_fence.hold_key("crashed"), keys_body([CHUNK]))
    store.now += 60
    assert GcRun(store).sweep([CHUNK], now=store.now, grace_s=60) == [CHUNK]
    assert not list(store.list(gc_fence.HOLDS))


def test_forgettable_keeps_runs_in_flight_and_recent_ones() -> None:
    store = MemoryStore()
    swept(store, "done")
    finish(store, "done")
    swept(store, "crashed", CHUNK)  # never done: dead once past its budget and delivery
    keep_s = 2 * 60 + BUDGET_S + DELIVERY_S
    store.now += keep_s - 1
    swept(store, "recent")
    finish(store, "recent")
    runs = runs_in(store.list("gc/"))
    assert gc_fence.forgettable(runs.values(), now=store.now, grace_s=60) == []
    forgotten = gc_fence.forgettable(runs.values(), now=store.now + 2, grace_s=60)
    assert sorted(forgotten) == sorted([*runs["done"].keys, *runs["crashed"].keys])
