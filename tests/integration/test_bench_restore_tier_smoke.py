"""bench/bench_restore_tier.py --quick runs end to end and writes the documented JSON.

Times are not asserted (the machine decides them); where each restore's bytes come
from is deterministic, so it is: S3 alone serves everything without the tier, the
node cache leaves S3 only the lost node's share, and peer replication leaves it none,
through the node agents with the job's directory mounted as through the directories
(``--via mount,dir``; the agents over HTTP alone are tests/integration/test_node_agent.py's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bench_runs import run_quick

pytestmark = pytest.mark.integration

VARIANTS = {"s3_only", "node_cache", "replicated"}


def test_quick_run_reads_the_lost_share_from_s3_only_without_replication(tmp_path: Path) -> None:
    vias = ("mount", "dir")
    report = run_quick("bench_restore_tier.py", tmp_path, table_header="ratio",
                       args=("--via", ",".join(vias)))  # fmt: skip
    share = report["lost_share_bytes"]
    assert share > 0 and report["replicated_bytes"] >= share
    variants = report["variants"]
    tiered = {f"{v}_w{w}_{via}" for v in VARIANTS - {"s3_only"} for w in (3, 2)
              for via in vias}  # fmt: skip
    assert set(variants) == {"s3_only_w3", "s3_only_w2"} | tiered
    for w in (3, 2):
        s3_only = variants[f"s3_only_w{w}"]["bytes"]
        assert s3_only["local"] == s3_only["peer"] == 0 and s3_only["s3"] > 0
        for via in vias:
            cached, replicated = (variants[f"{v}_w{w}_{via}"]["bytes"] for v in
                                  ("node_cache", "replicated"))  # fmt: skip
            assert cached["s3"] == share and cached["local"] > 0, (via, cached)
            assert replicated["s3"] == 0 and replicated["local"] + replicated["peer"] > 0, via
    hop = {name for name in report["ratios"] if name.endswith("_vs_dir")}
    assert hop == {f"{v}_w{w}_time_ratio_mount_vs_dir" for v in VARIANTS - {"s3_only"}
                   for w in (3, 2)}  # fmt: skip
    assert set(report["ratios"]) - hop == set(report["targets"])
