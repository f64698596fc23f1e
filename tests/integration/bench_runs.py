"""Running a bench script's --quick smoke run from the tests (tests/integration/test_bench_*)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import ROOT


def finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def run_quick(
    script: str, tmp_path: Path, *, table_header: str, args: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``python bench/<script> --quick --json`` (and ``args``): it exits 0, prints its
    table, and writes a report that names the machine; returns the report."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", "--quick", "--json", str(out), *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert table_header in proc.stdout
    report: dict[str, Any] = json.loads(out.read_text())
    assert {"nproc", "mem_gib", "torch"} <= set(report["machine"])
    return report
