"""bench/bench_restore_tier.py --quick runs end to end and writes the documented JSON.

Times are not asserted (the machine decides them); where each restore's bytes come
from is deterministic, so it is: S3 alone serves everything without the tier, the
node cache leaves S3 only the lost node's share, and peer replication leaves it none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bench_runs import run_quick

pytestmark = pytest.mark.integration

VARIANTS = {"s3_only", "node_cache", "replicated"}


def test_quick_run_reads_the_lost_share_from_s3_only_without_replication(tmp_path: Path) -> None:
    report = run_quick("bench_restore_tier.py", tmp_path, table_header="ratio")
    share = report["lost_share_bytes"]
    assert share > 0 and report["replicated_bytes"] >= share
    variants = report["variants"]
    assert set(variants) == {f"{v}_w{w}" for v in VARIANTS for w in (3, 2)}
    for w in (3, 2):
        s3_only, cached, replicated = (variants[f"{v}_w{w}"]["bytes"] for v in
                                       ("s3_only", "node_cache", "replicated"))  # fmt: skip
        assert s3_only["local"] == s3_only["peer"] == 0 and s3_only["s3"] > 0
        assert cached["s3"] == share and cached["local"] > 0
        assert replicated["s3"] == 0 and replicated["local"] + replicated["peer"] > 0
    assert set(report["ratios"]) == set(report["targets"])
