"""What the operator remembers of the watches between ticks (observe.py)."""

from __future__ import annotations

import time

from ctj_operator.observe import Freshness, node_rank


def test_freshness_counts_from_the_last_change_and_forgets_what_is_deleted() -> None:
    f = Freshness()
    f.see("lease", None)  # no renewTime yet: nothing to count from
    assert f.silent_for("lease") is None and len(f) == 0
    f.see("lease", "t1")
    first = f.changed_at("lease")
    time.sleep(0.01)
    f.see("lease", "t1")  # the same value again is not a beat
    assert f.changed_at("lease") == first
    silent = f.silent_for("lease")
    assert silent is not None and silent >= 0.01
    f.see("lease", "t2")
    renewed = f.silent_for("lease")
    assert renewed is not None and renewed < silent
    f.drop("lease")
    f.drop("never seen")
    assert f.silent_for("lease") is None and len(f) == 0


def test_a_rank_is_read_from_our_label_or_from_the_kubeflow_controllers() -> None:
    assert node_rank({"training.ctj.dev/node-rank": "2"}) == 2
    kf = "training.kubeflow.org/replica-"
    assert node_rank({f"{kf}type": "master", f"{kf}index": "0"}) == 0
    assert node_rank({f"{kf}type": "worker", f"{kf}index": "0"}) == 1
    assert node_rank({f"{kf}type": "worker", f"{kf}index": "4"}) == 5
