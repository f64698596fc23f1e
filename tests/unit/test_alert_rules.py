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
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_URL = "https://github.com/ctj/ctj/blob/main/docs/runbooks.md#"


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


def markdown_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    to hyphens (fenced code skipped)."""
    anchors: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and not fenced:
            title = heading.group(1).strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_markdown_anchors_as_github_makes_them() -> None:
    text = "# Runbooks: ctj's alerts\n```\n# not a heading\n```\n## CtjJobFailed\n"
    assert markdown_anchors(text) == {"runbooks-ctjs-alerts", "ctjjobfailed"}


def test_every_alert_links_its_own_runbook_section() -> None:
    """annotations.runbook_url: docs/runbooks.md, at a section that exists and is the
    alert's own (what it means, how to check, how to fix)."""
    anchors = markdown_anchors(RUNBOOKS.read_text())
    sections = RUNBOOKS.read_text().split("\n## ")[1:]
    body = {s.split("\n", 1)[0].strip(): s for s in sections}
    for a in alerts():
        url = a["annotations"].get("runbook_url", "")
        assert url == RUNBOOK_URL + a["alert"].lower(), a["alert"]
        assert url.removeprefix(RUNBOOK_URL) in anchors, f"docs/runbooks.md lacks {a['alert']}"
        text = body[a["alert"]]
        for part in ("**Means:**", "**Check:**", "**Fix:**"):
            assert part in text, f"{a['alert']}'s runbook lacks {part}"
    assert set(body) == {a["alert"] for a in alerts()}, "a runbook for an alert not shipped"


def test_per_job_alerts_keep_the_job_and_never_a_pod() -> None:
    """Alerts on a job's series aggregate to namespace and job_name: one identity across
    the job's attempts, whose pod names change (and across operator pods)."""
    process_wide = {"CtjOperatorAbsent", "CtjRecoverySlow"}
    for a in alerts():
        if a["alert"] in process_wide:
            continue
        expr = a["expr"]
        assert "by (namespace, job_name" in expr, a["alert"]
        assert "$labels.pod" not in a["annotations"]["description"], a["alert"]
        assert "job_name" in a["annotations"]["description"], a["alert"]
