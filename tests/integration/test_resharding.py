"""Save at one world size, load at others: every tensor bitwise equal (real S3, real gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_save_at_4_load_at_2_and_3_bitwise(kind: str, s3_uri: str, tmp_path: Path) -> None:
    args = {"kind": kind, "uri": s3_uri, "step": 5, "ref": str(tmp_path / "ref.pt")}
    run_ranks(4, "tests.integration.workers:save", args)
    for world_size in (2, 3):
        outputs = run_ranks(world_size, "tests.integration.workers:load_and_compare", args)
        # model (6 tensors) and AdamW (step, exp_avg, exp_avg_sq for each) all compared
        assert f"bitwise equal: 24 tensors at world size {world_size}" in outputs[0]
