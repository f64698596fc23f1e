"""bench/bench_size_sweep.py's arithmetic: seconds per GiB from the two benchmarks' reports,
and the growth of that cost from the smallest size that ran to the largest."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import ROOT

GIB = 1 << 30


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    sys.path.insert(0, str(Path(ROOT) / "bench"))  # it imports bench_checkpoint
    spec = importlib.util.spec_from_file_location(
        "bench_size_sweep", Path(ROOT) / "bench" / "bench_size_sweep.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reports(gib: int, ours_s: float, anchor_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """bench_checkpoint's and bench_restore_tier's reports, as far as the sweep reads them:
    every ours phase takes ``ours_s`` per GiB, every anchor ``anchor_s``."""
    phases = {
        name: {
            "seconds": ours_s * gib,
            "returned_seconds": ours_s * gib / 10,
            "cpu_seconds": ours_s * gib / 2,
        }
        for name in ("save_ours_full", "load_ours_w2", "load_ours_w1", "load_ours_w3")
    }
    phases |= {
        name: {"seconds": anchor_s * gib, "cpu_seconds": anchor_s * gib / 4}
        for name in ("save_boto3", "load_boto3_w2", "load_boto3_w1", "load_boto3_w3")
    }
    ckpt = {"config": {"total_bytes": gib * GIB}, "phases": phases}
    tier = {
        "config": {"total_bytes": gib * GIB},
        "variants": {
            "replicated_w2": {"seconds_median": ours_s * gib},
            "s3_only_w2": {"seconds_median": anchor_s * gib},
        },
    }
    return ckpt, tier


def test_every_phase_is_costed_per_gib_for_ours_and_its_anchor(sweep: ModuleType) -> None:
    phases = sweep.seconds_by_phase(*reports(2, ours_s=3.0, anchor_s=2.0))
    assert list(phases) == sweep.PHASES
    for name, row in phases.items():
        expected = 0.3 if name == "stall" else 3.0
        assert math.isclose(row["ours_seconds_per_gib"], expected), name
        if name == "stall":  # compared with the copy floor in bench_async.py, not here
            assert "anchor_seconds_per_gib" not in row and "ours_cpu_seconds_per_gib" not in row
        else:
            assert math.isclose(row["anchor_seconds_per_gib"], 2.0), name
        if name not in ("stall", "node_tier_restore_3to2"):  # the ranks' CPU, per GiB
            assert math.isclose(row["ours_cpu_seconds_per_gib"], 1.5), name
            assert math.isclose(row["anchor_cpu_seconds_per_gib"], 0.5), name


def test_growth_divides_the_largest_size_by_the_smallest_that_ran(sweep: ModuleType) -> None:
    sizes = {
        1024: {"phases": sweep.seconds_by_phase(*reports(1, ours_s=2.0, anchor_s=1.0))},
        4096: {"phases": sweep.seconds_by_phase(*reports(4, ours_s=2.2, anchor_s=1.5))},
        8192: {"failed": "out of memory"},  # not the largest that ran
    }
    values = sweep.growth(sizes)
    assert math.isclose(values["save_per_gib_ratio_4096mib_vs_1024mib"], 1.1)
    assert math.isclose(values["anchor_save_per_gib_ratio_4096mib_vs_1024mib"], 1.5)
    judged = sweep.judge(values)
    assert judged["save_per_gib_ratio_4096mib_vs_1024mib"]["met"] is True  # 1.1 <= 1.15
    assert not any(name.startswith("anchor_") for name in judged)  # shown, not judged
    assert sweep.growth({1024: sizes[1024], 8192: sizes[8192]}) == {}  # one size ran


def test_a_size_whose_tier_run_failed_keeps_its_other_phases(sweep: ModuleType) -> None:
    """8 GiB: bench_checkpoint ran, the node-tier restore did not (a full disk): the other
    phases' growth is taken to 8 GiB, the tier's to the largest size where it ran."""
    sizes = {
        1024: {"phases": sweep.seconds_by_phase(*reports(1, ours_s=2.0, anchor_s=1.0))},
        4096: {"phases": sweep.seconds_by_phase(*reports(4, ours_s=2.2, anchor_s=1.5))},
        8192: {"phases": sweep.seconds_by_phase(reports(8, ours_s=2.4, anchor_s=1.5)[0], None)},
    }
    assert "node_tier_restore_3to2" not in sizes[8192]["phases"]
    values = sweep.growth(sizes)
    assert math.isclose(values["save_per_gib_ratio_8192mib_vs_1024mib"], 1.2)
    assert math.isclose(values["node_tier_restore_3to2_per_gib_ratio_4096mib_vs_1024mib"], 1.1)
    report = {"sizes": {str(k): v for k, v in sizes.items()}, "ratios": values, "targets": {}}
    table = sweep.table(report)
    (tier_row,) = [
        line for line in table.splitlines() if line.startswith("node_tier_restore_3to2 ")
    ]
    assert tier_row.split()[-1] == "failed" and tier_row.count("failed") == 1  # 8 GiB's cell
    cpu = table.split("CPU-s per GiB")[1].splitlines()
    (save_cpu,) = [line for line in cpu if line.startswith("save ")]
    assert save_cpu.split()[1:] == [
        "1.000",
        "/",
        "0.250",
        "1.100",
        "/",
        "0.375",
        "1.200",
        "/",
        "0.375",
    ]
