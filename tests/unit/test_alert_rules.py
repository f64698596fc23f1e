"""The alerts ctj ships (charts/ctj/rules/ctj-alerts.yaml), checked by Prometheus' own
promtool: the rules parse, and each fires on series that should fire it and stays quiet on
series that should not (tests/rules/ctj-alerts.test.yaml)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.unit.test_chart_files import CHART, ROOT, defined_metrics

RULES = CHART / "rules" / "ctj-alerts.yaml"
RULE_TESTS = ROOT / "tests" / "rules" / "ctj-alerts.test.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: run hack/system-tools.sh (or ./hack/test.sh)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=ROOT)


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_rules_parse() -> None:
    check = promtool("check", "rules", str(RULES))
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in check.stdout


def test_each_alert_fires_on_what_it_should_and_only_that() -> None:
    run = promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == {a["alert"] for a in alerts()}


def test_the_rules_query_only_series_the_code_exports() -> None:
    known = set().union(*defined_metrics().values())
    used = {m for a in alerts() for m in re.findall(r"\bctj_[a-z0-9_]+\b", a["expr"])}
    assert used and used <= known, used - known


def test_every_alert_says_what_is_wrong_and_how_bad() -> None:
    for a in alerts():
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert a["annotations"]["summary"] and a["annotations"]["description"], a["alert"]
        assert a["alert"].startswith("Ctj"), a["alert"]


def test_the_slow_recovery_threshold_is_a_bucket_bound_as_exported() -> None:
    from ctj_operator.metrics import OperatorMetrics
    from prometheus_client import generate_latest

    (slow,) = [a for a in alerts() if a["alert"] == "CtjRecoverySlow"]
    (bound,) = re.findall(r'le="([0-9.]+)"', slow["expr"])
    text = generate_latest(OperatorMetrics().registry).decode()
    assert f'ctj_job_recovery_seconds_bucket{{le="{bound}"}}' in text
