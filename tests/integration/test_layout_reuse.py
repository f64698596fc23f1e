"""Saves after the first reuse DCP's plan while every rank's layout holds (real S3, gloo).

A reused save skips DCP's planning round; what it stages must load exactly as a
planned one would: at the same and at another world size, tensors bitwise,
non-tensor values (whose sizes change every save) equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

pytestmark = pytest.mark.integration


def test_saves_reuse_the_layout_until_it_changes_and_all_load(s3_uri: str, tmp_path: Path) -> None:
    args = {
        "kind": "fsdp",
        "uri": s3_uri,
        "ref": str(tmp_path / "ref.pt"),
        "config": {"keep_last": 0},  # every step stays loadable
    }
    outputs = run_ranks(2, "tests.integration.workers:save_series", args)
    # step 1 plans (no layout yet), step 2 plans (the optimizer joined), 3-5 reuse
    for out in outputs:
        assert "replanned: [True, True, False, False, False]" in out, out[-2000:]
    for world_size in (2, 3):
        outputs = run_ranks(world_size, "tests.integration.workers:load_series_and_compare", args)
        assert f"series bitwise equal at world size {world_size}" in outputs[0]
