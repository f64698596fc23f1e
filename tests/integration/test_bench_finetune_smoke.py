"""bench/bench_finetune.py --quick runs end to end, and frozen weights cost nothing.

Bytes are deterministic (times are not measured here): the first save uploads the
backbone once; every later checkpoint of a fine-tuning run, incremental or differential,
uploads about what training changed (the adapters and AdamW's state for them), not the
frozen backbone again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bench_runs import run_quick

pytestmark = pytest.mark.integration


def test_a_fine_tuning_checkpoint_uploads_the_trainable_state_not_the_backbone(
    tmp_path: Path,
) -> None:
    report = run_quick("bench_finetune.py", tmp_path, table_header="ratio")
    trainable, frozen = report["trainable_state_bytes"], report["frozen_bytes"]
    assert 0 < trainable < frozen / 4, (trainable, frozen)
    for mode in ("incremental", "differential"):
        m = report["modes"][mode]
        assert m["first_save_bytes"] >= frozen + trainable, m  # the backbone, once
        assert len(m["uploaded_bytes"]) == report["config"]["rounds"], m
        for uploaded, reported in zip(m["uploaded_bytes"], m["reported_uploaded_bytes"],
                                      strict=True):  # fmt: skip
            # at least the changed state (its chunks), at most 1.1x it with the metadata
            assert trainable <= uploaded <= 1.1 * trainable, (mode, uploaded, trainable)
            assert reported <= uploaded, (mode, reported, uploaded)
    assert all(t["met"] for t in report["targets"].values()), report["ratios"]
