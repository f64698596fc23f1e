"""bench/bench_async.py --quick runs end to end and writes the documented JSON, and so
does its --placed goodput (sidecar mode, pinned and shared cores).

Timing ratios are not asserted (they depend on the machine): only that every figure
is there and is a sane number.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.bench_runs import finite, run_quick

pytestmark = pytest.mark.integration

KEYS = {
    "command",
    "date",
    "config",
    "server",
    "engine",
    "machine",
    "stall",
    "goodput",
    "goodput_long",
    "ratios",
    "targets",
}
STALL_ROWS = {"ours", "dcp_sync", "dcp_async_default", "dcp_async_stager"}
GOODPUT_RUNS = {"no_checkpoint", "ours", "dcp_sync"}
TARGETS = {
    "stall_ratio_vs_floor",
    "stall_ratio_vs_dcp_best",
    "extra_memory_ratio",
    "goodput_ratio_vs_no_checkpoint",
    "wallclock_reduction_vs_sync",
}


def test_quick_run_writes_the_documented_json(tmp_path: Path) -> None:
    pytest.importorskip("s3torchconnector.dcp", reason="the DCP rows write through it")
    report = run_quick("bench_async.py", tmp_path, table_header="stall (slowest rank, median)")
    assert KEYS <= set(report), KEYS - set(report)
    assert report["config"]["world_size"] == 2 and report["config"]["quick"] is True

    assert set(report["stall"]) == STALL_ROWS
    for name, row in report["stall"].items():
        for key in ("returned_seconds", "safe_seconds", "floor_seconds"):
            assert finite(row[key]) and row[key] > 0, (name, key)
        assert row["safe_seconds"] >= row["returned_seconds"], name
        assert len(row["returned_per_repeat"]) == report["config"]["repeats"], name
        assert row["state_bytes_per_rank"] > 0, name
        assert finite(row["extra_memory_ratio"]) and row["extra_memory_ratio"] > 0, name
    ours = report["stall"]["ours"]
    assert ours["safe_seconds"] == ours["returned_seconds"]
    assert ours["staging_dir_bytes"] >= ours["state_bytes_per_rank"]  # one slot: the state

    for key, every in (("goodput", "every"), ("goodput_long", "long_every")):
        goodput = report[key]
        k = report["config"]["mlp"][every] if every == "every" else report["config"][every]
        assert GOODPUT_RUNS <= set(goodput), key
        rounds = goodput["rounds"]
        assert rounds >= 1 and goodput["steps_per_run"] == rounds * k, key
        for name in GOODPUT_RUNS:
            run = goodput[name]
            assert run["loop_seconds"] > 0 and run["steps_per_second"] > 0, (key, name)
            assert run["total_seconds"] >= run["loop_seconds"], (key, name)
            assert run["saves"] == (rounds if name in ("ours", "dcp_sync") else 0), (key, name)
            # the two ranks train on the CPU; the server (moto, started by the script) works
            # whenever anything is saved
            assert run["trainer_cpu_seconds"] > 0, (key, name)
            if name != "no_checkpoint":
                assert run["server_cpu_seconds"] > 0, (key, name)

    ratios = report["ratios"]
    assert TARGETS <= set(ratios) and set(report["targets"]) == TARGETS
    assert {"goodput_ratio_vs_no_checkpoint_long", "wallclock_reduction_vs_sync_long"} <= set(
        ratios
    )
    for name, value in ratios.items():
        assert finite(value), name
    for name, target in report["targets"].items():
        assert target["value"] == ratios[name] and isinstance(target["met"], bool), name
        assert target["target"].split()[0] in ("<=", ">="), name


PLACED_RATIOS = (
    "goodput_ratio_{}_vs_no_checkpoint",
    "loop_ratio_{}_vs_no_checkpoint",
    "checkpoint_cpu_seconds_per_save_{}",
    "seconds_between_saves_{}",
)


def test_quick_placed_run_puts_the_ranks_apart_from_the_sidecar_and_the_server(
    tmp_path: Path,
) -> None:
    pytest.importorskip("s3torchconnector.dcp", reason="the DCP stall rows write through it")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--placed needs 2 cores: one for the ranks, one for the checkpoint path")
    report = run_quick("bench_async.py", tmp_path, table_header="pinned (ranks", args=("--placed",))
    assert report["goodput"] is None and report["goodput_long"] is None  # replaced
    placed = report["goodput_placed"]
    assert set(placed) == {"pinned", "shared"}
    pinned = placed["pinned"]["cores"]
    assert pinned["ranks"] and pinned["checkpoint"]
    assert not set(pinned["ranks"]) & set(pinned["checkpoint"])
    for where, g in placed.items():
        assert set(g) >= {"no_checkpoint", "ours"} and "dcp_sync" not in g, where
        ours = g["ours"]
        assert ours["saves"] == g["rounds"] >= 1 and ours["total_seconds"] > 0, where
        # ours persisted through the sidecar process, to the server
        assert ours["sidecar_cpu_seconds"] > 0 and ours["server_cpu_seconds"] > 0, where
        for ratio in PLACED_RATIOS:
            value = report["ratios"][ratio.format(where)]
            assert finite(value) and value > 0, (ratio, where)
    assert isinstance(report["targets"]["goodput_ratio_pinned_vs_no_checkpoint"]["met"], bool)
