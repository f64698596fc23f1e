"""The Helm chart and the Dockerfile, checked as files (no helm, no cluster, no Docker).

What can drift silently is checked here: the chart's CRD copy, the dashboard's metric
names against the code that defines them, the values' comments and schema, the image
pins. tests/cluster/test_chart.py renders and installs the chart with a real helm.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ctj"
DASHBOARD = CHART / "dashboards" / "ctj.json"
METRIC_MODULES = (
    ROOT / "trainer_sidecar" / "metrics.py",
    ROOT / "operator" / "ctj_operator" / "metrics.py",
)

# the series names prometheus_client exposes for each metric type
_SUFFIXES = {
    "Histogram": ("_bucket", "_count", "_sum"),
    "Summary": ("", "_count", "_sum"),
    "Counter": ("_total",),
    "Gauge": ("",),
}
# a metric object, or a family a custom collector yields at scrape time
_DEFINITION = re.compile(
    r"\b(Histogram|Summary|Counter|Gauge)(?:MetricFamily)?\(\s*\"(ctj_[a-z0-9_]+)\""
)
_METRIC_IN_EXPR = re.compile(r"\bctj_[a-z0-9_]+\b")


def defined_metrics() -> dict[str, set[str]]:
    """Metric family → the series names it exposes, from the metrics modules' source."""
    families: dict[str, set[str]] = {}
    for module in METRIC_MODULES:
        for kind, name in _DEFINITION.findall(module.read_text()):
            family = name.removesuffix("_total") if kind == "Counter" else name
            families[family] = {family + suffix for suffix in _SUFFIXES[kind]}
    return families


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs: list[str] = []
    for panel in dashboard["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            exprs += [t["expr"] for t in sub.get("targets", [])]
    return exprs


def undefined_series(dashboard: dict) -> set[str]:
    """Names a dashboard queries that no metrics module defines (empty when all is well)."""
    known = set().union(*defined_metrics().values())
    return {m for e in dashboard_exprs(dashboard) for m in _METRIC_IN_EXPR.findall(e)} - known


def test_chart_crds_are_identical_to_crds() -> None:
    ours = {p.name: p.read_bytes() for p in sorted((ROOT / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted((CHART / "crds").iterdir())}
    assert ours, "crds/ is empty"
    assert chart.keys() == ours.keys(), "charts/ctj/crds/ must hold exactly crds/'s files"
    for name in ours:
        assert chart[name] == ours[name], f"charts/ctj/crds/{name} differs: cp crds/* charts/ctj/"


def test_the_metric_modules_define_what_the_readme_documents() -> None:
    families = defined_metrics()
    assert "ctj_checkpoint_stall_seconds" in families and "ctj_jobs" in families
    assert families["ctj_checkpoint_bytes"] == {"ctj_checkpoint_bytes_total"}
    assert "ctj_job_recovery_seconds_bucket" in families["ctj_job_recovery_seconds"]
    assert families["ctj_staging_used_bytes"] == {"ctj_staging_used_bytes"}  # a collector's


def test_dashboard_queries_only_metrics_the_code_defines() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert undefined_series(dashboard) == set()


def test_dashboard_shows_every_metric_the_code_defines() -> None:
    used = " ".join(dashboard_exprs(json.loads(DASHBOARD.read_text())))
    missing = {
        family
        for family, series in defined_metrics().items()
        if not any(re.search(rf"\b{s}\b", used) for s in series)
    }
    assert missing == set(), f"add a panel to {DASHBOARD.relative_to(ROOT)} for {missing}"


JOB_FILTER = 'namespace=~"$namespace", job_name=~"$job"'
_P95 = "histogram_quantile(0.95, sum by (namespace, job_name, le) (rate({}_bucket{{" + JOB_FILTER
# one sidecar exports each rank of its pod (label rank): the slowest rank's p95 per job
_SLOWEST_RANK = (
    "max by (namespace, job_name) (histogram_quantile(0.95, sum by (namespace, job_name, rank, "
    "le) (rate({}_bucket{{" + JOB_FILTER
)
# series of the operator as a whole: they carry no job to filter by (their panels say
# "all jobs"); every other series of the dashboard is filtered by both variables
PROCESS_WIDE = {
    "ctj_jobs",
    "ctj_job_restarts_total",
    "ctj_job_recovery_seconds_bucket",
    "ctj_job_recovery_seconds_count",
    'ctj_build_info{component="operator"}',
}
_SELECTOR = re.compile(r"\b(ctj_[a-z0-9_]+)(\{[^}]*\})?")


@pytest.mark.parametrize(
    ("title", "expected"),
    [
        ("Stall p50 / p95", _P95.format("ctj_checkpoint_stall_seconds")),
        ("Upload p50 / p95", _P95.format("ctj_checkpoint_upload_seconds")),
        ("Stall p50 / p95", _SLOWEST_RANK.format("ctj_checkpoint_stall_seconds")),
        ("Upload p50 / p95", _SLOWEST_RANK.format("ctj_checkpoint_upload_seconds")),
        ("Commit p50 / p95", _P95.format("ctj_checkpoint_commit_seconds")),
        ("Restore p50 / p95", _P95.format("ctj_checkpoint_restore_seconds")),
        ("Checkpoint bytes rate by kind", "sum by (namespace, job_name, kind) (rate(ctj_chec"),
        ("Failures by stage", "sum by (namespace, job_name, stage) (increase(ctj_checkpoint_"),
        ("Time since last committed checkpoint", "time() - max by (namespace, job_name) (ctj_"),
        ("Time since last committed checkpoint", "_timestamp_seconds{" + JOB_FILTER + "} > 0)"),
        ("Last committed checkpoint (operator)", "time() - max by (namespace, job_name) (ctj_job"),
        ("World size and attempt", "max by (namespace, job_name) (ctj_job_world_size{"),
        ("World size and attempt", "max by (namespace, job_name) (ctj_job_attempt{"),
        ("Staging volume use", "(ctj_staging_used_bytes{" + JOB_FILTER + "} / ctj_staging_cap"),
        ("Jobs by phase", "count by (phase) (ctj_job_phase{" + JOB_FILTER + "} == 1)"),
        ("Job restarts by reason (all jobs)", "sum by (reason) (increase(ctj_job_restarts_total["),
        (
            "Recovery time p50 / p95 (all jobs)",
            "histogram_quantile(0.95, sum by (le) (rate(ctj_job_recovery_seconds_bucket[",
        ),
        ("Operator version and jobs tracked (all jobs)", "sum by (phase) (ctj_jobs)"),
    ],
)
def test_dashboard_panel_queries(title: str, expected: str) -> None:
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    assert title in panels
    assert any(expected in t["expr"] for t in panels[title]["targets"])
    assert panels[title]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def unfiltered_selectors(expr: str) -> set[str]:
    """The series an expression selects without both job variables, as ``name{matchers}``
    (just ``name`` where it has none)."""
    return {
        f"{name}{matchers or ''}"
        for name, matchers in _SELECTOR.findall(expr)
        if JOB_FILTER not in (matchers or "")
    }


def test_unfiltered_selectors() -> None:
    assert unfiltered_selectors('sum(x{a="1"}) + ctj_a{' + JOB_FILTER + "} + ctj_b") == {"ctj_b"}
    assert unfiltered_selectors('ctj_c{namespace=~"$namespace"}') == {
        'ctj_c{namespace=~"$namespace"}'
    }


def test_dashboard_has_namespace_and_job_variables_and_every_job_query_uses_them() -> None:
    """A namespace and a job variable (multi, All = every value, the job's choices within
    the namespaces chosen), and each series a panel selects filtered by both, but for the
    operator's process-wide ones, shown in panels titled as over all jobs."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for name, label in (("namespace", "namespace"), ("job", "job_name")):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], name
        assert v["allValue"] == ".*", name  # also matches a series without the label
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert v["query"]["query"].startswith("label_values(ctj_job_phase")
        assert v["query"]["query"].endswith(f", {label})")
    assert '{namespace=~"$namespace"}' in variables["job"]["query"]["query"]
    process_wide_panels = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            loose = unfiltered_selectors(target["expr"])
            assert loose <= PROCESS_WIDE, (panel["title"], loose)
            if loose:
                process_wide_panels.add(panel["title"])
    assert process_wide_panels and all(t.endswith("(all jobs)") for t in process_wide_panels)


def test_dashboard_is_well_formed_for_grafana() -> None:
    """What Grafana needs to import it: a schema version it migrates from, the datasource
    variable every query names, unique panel ids and refIds, panels that do not overlap."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule (Grafana's $__rate_interval → 5m)."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: run hack/system-tools.sh (or ./hack/test.sh)")
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    rules = [
        {"record": f"ctj:dashboard_query_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(exprs)
    ]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules)} rules found" in check.stdout


def _undocumented_values(lines: list[str]) -> list[str]:
    """Keys with no `# --` comment block directly above, unless their parent has one (then
    the key is part of that documented value). Groups (a key without one) hold only keys."""
    missing: list[str] = []
    documented_depth: int | None = None  # indentation of the documented value we are inside
    for i, line in enumerate(lines):
        key = re.match(r"^( *)([A-Za-z0-9_]+):", line)
        if not key:
            continue
        indent = len(key.group(1))
        if documented_depth is not None and indent > documented_depth:
            continue
        documented_depth = None
        block = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            block.append(lines[j].strip())
            j -= 1
        if any(c.startswith("# --") for c in block):
            documented_depth = indent
        elif line.rstrip().endswith(":"):
            continue  # a group: its keys are checked one by one
        else:
            missing.append(f"line {i + 1}: {line.strip()}")
    return missing


def test_every_value_has_a_comment() -> None:
    assert _undocumented_values((CHART / "values.yaml").read_text().splitlines()) == []
    # and the checker itself catches an undocumented value
    assert _undocumented_values(["image:", "  # -- repo", "  repository: x", "  tag: y"]) == [
        "line 4: tag: y"
    ]


def test_values_match_the_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**values, "replicaCount": -1}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**values, "imageTag": "typo"}, schema)


def test_locked_down_security_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    container, pod = values["securityContext"], values["podSecurityContext"]
    assert container["runAsNonRoot"] and pod["runAsNonRoot"]
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert container["seccompProfile"] == pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert values["serviceMonitor"]["enabled"] is False
    assert values["grafanaDashboard"]["enabled"] is True
    assert values["grafanaDashboard"]["labels"] == {"grafana_dashboard": "1"}


def test_chart_app_version_is_the_project_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


def _dockerfile_arg(text: str, name: str) -> list[str]:
    match = re.search(rf'^ARG {name}="([^"]*)"', text, re.M)
    assert match, f"Dockerfile has no ARG {name}"
    return match.group(1).split()


def test_dockerfile_targets_and_pins() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, re.M)
    assert {"operator", "trainer"} <= set(stages)
    pinned = {
        re.sub(r"\[.*\]", "", line.split("==")[0])
        for line in (ROOT / "requirements" / "dev.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    operator = _dockerfile_arg(text, "OPERATOR_PACKAGES")
    trainer = _dockerfile_arg(text, "TRAINER_PACKAGES")
    assert set(operator) <= pinned and set(trainer) <= pinned and "torch" in pinned
    assert "torch" not in operator, "the operator image must not carry torch"
    operator_stage = text.split("AS operator\n", 1)[1].split("\nFROM ", 1)[0]
    assert 'ENTRYPOINT ["python", "-m", "ctj_operator"]' in operator_stage
    assert re.search(r"^USER 65532", operator_stage, re.M)


def test_the_operator_image_holds_everything_the_operator_imports() -> None:
    """The operator and the contract import only the standard library, each other and
    OPERATOR_PACKAGES: the image has nothing else (no torch, no engine)."""
    text = (ROOT / "Dockerfile").read_text()
    packages = {p.replace("-", "_") for p in _dockerfile_arg(text, "OPERATOR_PACKAGES")}
    stage = text.split("AS operator\n", 1)[1].split("\nFROM ", 1)[0]
    copied = set(re.findall(r"^COPY \S+ /app/(\w+)/$", stage, re.M))
    assert copied == {"ctj_contract", "ctj_operator"}
    imported: set[str] = set()
    for folder in ("operator/ctj_operator", "contract/ctj_contract"):
        for path in (ROOT / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    imported.add(node.module.split(".")[0])
    outside = imported - set(sys.stdlib_module_names) - packages - copied
    assert not outside, f"the operator imports {sorted(outside)}, which its image lacks"


def test_dockerignore_lets_in_what_the_dockerfile_copies() -> None:
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    sources = re.findall(r"^COPY (?!--from)(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert sources
    for source in sources:
        assert source.rstrip("/") in allowed, f".dockerignore keeps {source} out of the context"
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
