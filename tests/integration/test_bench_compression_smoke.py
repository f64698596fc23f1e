"""bench/bench_compression.py --quick runs end to end and writes the documented JSON.

Speeds are not asserted (they depend on the machine), nor therefore which codec the
measurement chooses. What is deterministic is: every variant round-trips (the script
checks), byte planes beat plain zstd on every float class, auto splits them, and the
saves through the real engine load back bitwise (the script checks) with auto storing
the fewest bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bench_runs import finite, run_quick

pytestmark = pytest.mark.integration

KEYS = {"command", "date", "config", "engine", "machine", "training", "classes", "chosen"}
CLASSES = {
    "fp32 weights",
    "fp32 adam exp_avg",
    "fp32 adam exp_avg_sq",
    "bf16 weights",
    "fp16 weights",
    "fp32 small tensors (packs)",
}


def test_quick_run_writes_the_documented_json(tmp_path: Path) -> None:
    report = run_quick("bench_compression.py", tmp_path, table_header="break-even MB/s")
    assert KEYS | {"saves", "ratios", "targets"} <= set(report)
    assert report["config"]["quick"] is True
    assert {c["class"] for c in report["classes"]} == CLASSES
    for cls in report["classes"]:
        rows = {r["variant"]: r for r in cls["variants"]}
        bp = "zstd-bp2" if cls["class"].startswith(("bf16", "fp16")) else "zstd-bp4"
        assert {"none", "zstd", bp, f"{bp} L3", "zstd L9", f"{bp} one frame"} <= set(rows)
        for r in rows.values():
            assert finite(r["ratio"]) and finite(r["compress_mb_per_cpu_s"]), r
        assert rows["none"]["ratio"] == 1.0
        assert rows[bp]["ratio"] > rows["zstd"]["ratio"] > 1.0, cls["class"]
        assert cls["auto"] == bp  # auto splits every chunk of these classes
        assert cls["chosen"] in rows  # which one is chosen depends on the machine's speed
    assert set(report["auto_agrees_with_measurement"]) == CLASSES
    saves = report["saves"]["by_compression"]
    assert set(saves) == {"none", "zstd", "auto"}
    for s in saves.values():
        assert finite(s["seconds"]) and s["seconds"] > 0 and finite(s["cpu_seconds"])
    assert saves["auto"]["stored_bytes"] < saves["zstd"]["stored_bytes"]
    assert saves["zstd"]["stored_bytes"] < saves["none"]["stored_bytes"]
    assert ".bp4.zst" in saves["auto"]["chunks_by_suffix"]
    assert ".bp2.zst" in saves["auto"]["chunks_by_suffix"]
    assert set(saves["none"]["chunks_by_suffix"]) == {"(raw)"}
    ratios = report["ratios"]
    assert ratios["save_stored_bytes_ratio_auto_vs_none"] < 1
