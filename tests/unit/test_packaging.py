"""What ships: the product's wheel holds the engine, the operator and the contract; the
development harness (hack/: local clusters, kind tooling, stack helpers) is a distribution
of its own that users never install."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

PRODUCT = {"trainer_sidecar", "ctj_operator", "ctj_contract"}
HARNESS = {"ctj_devcluster", "ctj_stack"}
SOURCES = {
    ".": ("pyproject.toml", "README.md", "trainer_sidecar", "operator", "contract"),
    "hack": ("pyproject.toml", "ctj_devcluster", "ctj_stack"),
}


def build_wheel(project: str, tmp: Path) -> zipfile.ZipFile:
    """Built from a copy of the project's sources (setuptools builds in the tree)."""
    src, out = tmp / "src", tmp / "out"
    for name in SOURCES[project]:
        path = Path(ROOT) / project / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, src / name)
    out.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        cwd=out,
    )
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def top_level(wheel: zipfile.ZipFile) -> set[str]:
    return {name.split("/")[0] for name in wheel.namelist() if ".dist-info" not in name}


@pytest.mark.parametrize(("project", "packages"), [(".", PRODUCT), ("hack", HARNESS)])
def test_each_wheel_holds_its_packages_and_nothing_of_the_other(
    project: str, packages: set[str], tmp_path: Path
) -> None:
    wheel = build_wheel(project, tmp_path)
    assert top_level(wheel) == packages
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    scripts = wheel.read(entry_points).decode()
    assert ("ctj-devcluster" in scripts) == (packages == HARNESS)
