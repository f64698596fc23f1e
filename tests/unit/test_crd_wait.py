"""Waiting for a CRD to be served: a status not written yet is "not yet", never an error
(``kubectl wait --for=condition=Established`` fails at once on one, which made the
cluster tier's fixtures fail when the API server was slow to write it)."""

from __future__ import annotations

import pytest
from ctj_devcluster.cluster import ESTABLISHED, wait_crd_established


def test_waits_through_a_status_not_written_yet_until_established() -> None:
    answers = iter(["", "", "False", "True"])
    calls: list[tuple[str, ...]] = []

    def kubectl(*args: str) -> str:
        calls.append(args)
        return next(answers)

    wait_crd_established(kubectl, "widgets.test.ctj.dev", timeout=10)
    assert len(calls) == 4
    assert calls[0] == ("get", "crd", "widgets.test.ctj.dev", f"-o=jsonpath={ESTABLISHED}")


def test_a_crd_never_established_times_out_naming_it() -> None:
    with pytest.raises(TimeoutError, match="widgets.test.ctj.dev"):
        wait_crd_established(lambda *a: "", "widgets.test.ctj.dev", timeout=0.5)
