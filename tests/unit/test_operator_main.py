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


def test_every_watch_names_its_api_group_so_start_up_reads_no_other_group() -> None:
    """kopf reads the discovery of every group the cluster serves when any selector leaves
    its group out ("pods"), and one broken aggregated API (Kueue's visibility server on
    kind answered 404) kept the operator from starting; with each group named it reads
    only those. Registered here on a fresh registry, as __main__ registers them."""
    import kopf
    from ctj_operator import handlers
    from ctj_operator.spec import Backend

    registry = kopf.OperatorRegistry()
    default = kopf.get_default_registry()
    kopf.set_default_registry(registry)
    try:
        import importlib

        importlib.reload(handlers)  # its decorators register into the fresh registry
        handlers.register_reconcile()
        handlers.register_attempts(Backend.PYTORCHJOB)
        handlers.register_attempts(Backend.TRAINJOB)
        handlers.register_kueue()
    finally:
        kopf.set_default_registry(default)
        importlib.reload(handlers)
    found = [
        h.selector
        for kind in (
            registry._indexing,
            registry._watching,
            registry._spawning,
            registry._changing,
        )  # fmt: skip
        for h in kind.get_all_handlers()
    ]
    assert len(found) >= 8, found
    assert all(s is not None and s.group is not None for s in found), found
