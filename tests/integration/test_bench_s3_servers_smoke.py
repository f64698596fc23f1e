"""bench/bench_s3_servers.py --quick starts both loopback servers, sends every phase's
requests to each, and reports the server's CPU per GiB and per request."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bench_runs import finite, run_quick

pytestmark = pytest.mark.integration


def test_quick_run_measures_both_servers(tmp_path: Path) -> None:
    report = run_quick("bench_s3_servers.py", tmp_path, table_header="server CPU")
    assert set(report["servers"]) == {"moto", "seaweedfs"}
    for kind, measured in report["servers"].items():
        phases = measured["phases"]
        assert set(phases) == {"put_8mib", "get_8mib", "put_4kib", "head", "list"}, kind
        for name, figures in phases.items():
            per = figures.get("cpu_seconds_per_gib", figures.get("cpu_ms_per_request"))
            assert finite(per) and per >= 0, (kind, name, figures)
            assert figures["seconds"] > 0, (kind, name, figures)
    assert set(report["ratios"]) == {f"{n}_cpu_seaweedfs_vs_moto" for n in phases}
