"""The operator's command line: a bad flag is refused before anything connects."""

from __future__ import annotations

import pytest
from ctj_operator.__main__ import main


@pytest.mark.parametrize("value", ["0", "0.05", "11", "-1"])
def test_a_reconcile_interval_out_of_range_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--reconcile-interval", value])
    assert exited.value.code == 2
    assert "--reconcile-interval" in capsys.readouterr().err
