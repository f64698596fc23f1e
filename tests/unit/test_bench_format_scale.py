"""bench/bench_format_scale.py --quick runs (in memory, seconds) and shows what it claims:
a v3 rank reads its share, so the gap to v2 widens with the world size."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_format_scale", Path(ROOT) / "bench" / "bench_format_scale.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_the_table_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scale.json"
    assert bench().main(["--quick", "--json", str(out)]) == 0
    assert "ratio (v3 / v2)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["worlds"] == [4, 16] and {"nproc", "mem_gib"} <= set(report["machine"])
    rows = {(r["ranks"], r["scenario"].split(":")[0]): r for r in report["rows"]}
    by_world: dict[int, list[dict[str, object]]] = {}
    for r in report["rows"]:
        by_world.setdefault(r["ranks"], []).append(r)
        assert r["v3"]["bytes"] < r["v2"]["bytes"], r  # every actor reads less
    commit_4, commit_16 = rows[(4, "commit (rank 0)")], rows[(16, "commit (rank 0)")]
    assert commit_4["v3"]["requests"] == 5 and commit_16["v3"]["requests"] == 17  # W parts + 1
    for scenario in ("load", "save dedup"):
        small = [r for r in by_world[4] if str(r["scenario"]).startswith(scenario)]
        large = [r for r in by_world[16] if str(r["scenario"]).startswith(scenario)]
        # v2 reads grow with the world size (4x), a v3 rank's own share barely does
        assert min(r["v2"]["bytes"] for r in large) > 3 * max(r["v2"]["bytes"] for r in small)
        assert max(r["bytes_ratio_v3_vs_v2"] for r in large) < min(
            r["bytes_ratio_v3_vs_v2"] for r in small
        )
