"""bench/bench_checkpoint.py --quick runs end to end and writes the documented JSON.

Timing ratios are not asserted (they depend on the machine); the incremental
save's uploaded fraction is deterministic, so it is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bench_runs import run_quick

pytestmark = pytest.mark.integration

KEYS = {"command", "date", "config", "server", "engine", "machine", "phases", "ratios", "targets"}
SAVE_PHASES = {"save_boto3", "save_boto3_objects", "save_ours_full", "save_ours_incremental"}
LOAD_PHASES = {f"load_{who}_w{w}" for who in ("ours", "boto3") for w in (1, 2, 3)}
S3TC_PHASES = {"save_s3torchconnector"} | {f"load_s3torchconnector_w{w}" for w in (1, 2, 3)}
S3TC_RATIOS = {
    "save_throughput_ratio_vs_s3torchconnector",
    *(f"load_throughput_ratio_vs_s3torchconnector_2to{w}" for w in (1, 2, 3)),
    *(f"load_bytes_fetched_ratio_vs_s3torchconnector_2to{w}" for w in (1, 2, 3)),
}


def test_quick_run_writes_the_documented_json(tmp_path: Path) -> None:
    report = run_quick("bench_checkpoint.py", tmp_path, table_header="ratio (ours / anchor)")
    assert report["config"]["save_world_size"] == 2
    assert report["config"]["load_world_sizes"] == [2, 1, 3]
    phases = report["phases"]
    assert SAVE_PHASES | LOAD_PHASES <= set(phases)
    for name, phase in phases.items():
        assert phase["seconds"] > 0 and phase["mb_per_s"] > 0, name
        # the client's CPU per byte, every phase, measured in the ranks' own processes
        assert phase["cpu_seconds"] > 0 and phase["cpu_seconds_per_gib"] > 0, name
    assert phases["save_ours_full"]["mode"] == "full"
    assert phases["save_ours_incremental"]["mode"] == "incremental"

    ratios = report["ratios"]
    assert {"save_throughput_ratio_vs_boto3", "incremental_uploaded_fraction"} <= set(ratios)
    assert {f"load_throughput_ratio_vs_raw_get_2to{w}" for w in (1, 2, 3)} <= set(ratios)
    assert {
        "save_cpu_ratio_vs_boto3",
        *(f"load_cpu_ratio_vs_raw_get_2to{w}" for w in (1, 2, 3)),
    } <= set(ratios)
    for w in (1, 2, 3):  # the raw GETs read the whole state, once, at every world size
        assert phases[f"load_boto3_w{w}"]["bytes_fetched"] == report["config"]["total_bytes"]
    assert report["config"]["changed_fraction"] == pytest.approx(0.10)
    assert 0.09 <= ratios["incremental_uploaded_fraction"] <= 0.12
    assert report["targets"]["incremental_uploaded_fraction"]["met"] is True

    if report["skipped"] is None:  # s3torchconnector importable: its rows and ratios too
        assert S3TC_PHASES <= set(phases)
        assert S3TC_RATIOS <= set(ratios)
    else:
        assert "s3torchconnector" in report["skipped"]
        assert not S3TC_PHASES & set(phases)
