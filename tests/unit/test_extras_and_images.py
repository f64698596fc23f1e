"""The package's extras and the images agree on what needs torch: the base package is the
sidecar's (its image has exactly the base dependencies), torch comes with `ctj[trainer]`,
and hack/containers/images.sh builds every image the Dockerfile defines (the e2e tier
loads into kind whatever it prints)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from ctj_operator import builders

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# what a distribution lets its users import, where that is not its own name (botocore
# comes with boto3, and urllib3 with botocore, whose errors store/s3_errors.py tells apart)
IMPORT_NAMES = {
    "boto3": {"boto3", "botocore", "urllib3"},
    "prometheus-client": {"prometheus_client"},
}


def _name(requirement: str) -> str:
    """The distribution a requirement names: "ctj[trainer]", "torch>=2.9" -> ctj, torch."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match.group(0).lower()


def _arg(name: str) -> list[str]:
    match = re.search(rf'^ARG {name}="([^"]*)"', DOCKERFILE, re.M)
    assert match, f"Dockerfile has no ARG {name}"
    return match.group(1).split()


def _stage(name: str) -> tuple[str, str]:
    """The stage's parent and its text."""
    match = re.search(rf"^FROM (\S+) AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S)
    assert match, f"Dockerfile has no stage {name}"
    return match.group(1), match.group(2)


def test_the_base_package_needs_no_torch_and_the_trainer_extra_brings_it() -> None:
    base = {_name(r) for r in PROJECT["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in PROJECT["optional-dependencies"].items()}
    assert "torch" not in base
    assert "kubernetes" in base, "the sidecar's heartbeat imports kubernetes"
    assert "torch" in extras["trainer"]
    assert "kopf" in extras["operator"] and "torch" not in extras["operator"]
    for extra in ("export", "dev"):  # export and the test suite load checkpoints: torch
        assert "torch" in extras[extra] or "ctj" in extras[extra], extra


def test_the_sidecar_image_holds_exactly_the_base_dependencies() -> None:
    base = {_name(r) for r in PROJECT["dependencies"]}
    assert set(_arg("SIDECAR_PACKAGES")) == base
    parent, sidecar = _stage("sidecar")
    assert parent == "sidecar-deps"
    assert set(re.findall(r"^COPY \S+ /app/(\w+)/$", sidecar, re.M)) == {
        "ctj_contract",
        "trainer_sidecar",
    }
    assert re.search(r"^USER 65532", sidecar, re.M)
    # torch only where the trainer is, on top of the sidecar's venv (a layer shared)
    trainer_parent, trainer_deps = _stage("trainer-deps")
    assert trainer_parent == "sidecar-deps" and "torch" in trainer_deps
    for stage in ("base", "operator-deps", "sidecar-deps", "operator", "sidecar"):
        lines = [line for line in _stage(stage)[1].splitlines() if not line.startswith("#")]
        assert "torch" not in "\n".join(lines), stage


def test_what_the_sidecar_loads_imports_only_what_its_image_has() -> None:
    """Every module of ours the sidecar and the store commands load (in a fresh
    interpreter), read for its imports, function-level ones included."""
    code = (
        "import json, sys, trainer_sidecar.cli, trainer_sidecar.sidecar, "
        "trainer_sidecar.metrics, trainer_sidecar.heartbeat, trainer_sidecar.store.s3\n"
        "print(json.dumps(sorted(getattr(m, '__file__', None) or '' for n, m in "
        "sys.modules.items() if n.split('.')[0] in ('trainer_sidecar', 'ctj_contract'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    files = [Path(f) for f in json.loads(proc.stdout) if f]
    assert any(f.name == "heartbeat.py" for f in files)
    allowed = {"trainer_sidecar", "ctj_contract", *sys.stdlib_module_names}
    for package in _arg("SIDECAR_PACKAGES"):
        allowed |= IMPORT_NAMES.get(package, {package.replace("-", "_")})
    outside: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] not in allowed:
                    outside.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    assert not outside, f"the sidecar image lacks what these import: {outside}"


def test_images_sh_builds_every_image_the_dockerfile_defines() -> None:
    """Each final target (not a base or a deps stage) is built by default and printed as
    CTJ_<TARGET>_IMAGE, which hack/stack-env.sh loads into kind and passes on."""
    targets = {
        s for s in re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE, re.M)
        if s != "base" and not s.endswith("-deps")
    }  # fmt: skip
    assert targets == {"operator", "sidecar", "trainer"}
    script = (ROOT / "hack" / "containers" / "images.sh").read_text()
    default = re.search(r"\|\| wanted=\(([^)]*)\)", script)
    assert default and targets <= set(default.group(1).split())
    for target in targets:
        assert f"CTJ_{target.upper()}_IMAGE=" in script
    assert "ctj/(operator|sidecar|trainer|" in script, "--prune knows every ctj image"


def test_the_operator_s_default_sidecar_image_is_the_chart_s() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "ctj" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "ctj" / "values.yaml").read_text())
    repository = values["sidecarImage"]["repository"]
    assert repository.endswith("/sidecar"), "the torch-free target, not the trainer"
    assert builders.DEFAULT_SIDECAR_IMAGE == f"{repository}:{chart['appVersion']}"
    assert chart["appVersion"] == PROJECT["version"]
