"""charts/ctj rendered by the real helm (hack/cluster-binaries.sh builds it into
~/.cache/ctj), with no cluster: the fixture and helpers the chart's tests share.

Where helm is missing the tests that use it skip and say how to build it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from ctj_devcluster.binaries import BinariesMissing, find_helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ctj"

Helm = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """`helm(*args, check=True)` → CompletedProcess, with private helm homes."""
    try:
        binary = find_helm()
    except BinariesMissing as exc:
        pytest.skip(str(exc))
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(binary), *args], env=env, capture_output=True, text=True, timeout=60
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
        return proc

    return run


def render(
    helm: Helm,
    *sets: str,
    release: str = "ctj-operator",
    namespace: str = "ctj-system",
    chart: Path = CHART,
) -> dict[tuple[str, str], Any]:
    """`helm template` → {(kind, name): object}."""
    args = ["template", release, str(chart), "-n", namespace]
    for s in sets:
        args += ["--set", s]
    docs = yaml.safe_load_all(helm(*args).stdout)
    return {(d["kind"], d["metadata"]["name"]): d for d in docs if d}


def the(objects: dict[tuple[str, str], Any], kind: str) -> Any:
    found = [o for (k, _), o in objects.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def render_notes(helm: Helm, tmp_path: Path, *sets: str, release: str = "ctj-operator") -> str:
    """templates/NOTES.txt as `helm install` prints it. `helm template` skips NOTES and a
    client-only install still wants a cluster, so a copy of the chart renders the same
    text, by the same engine and values, into a ConfigMap."""
    copy = tmp_path / "ctj"
    shutil.copytree(CHART, copy)
    notes = (copy / "templates" / "NOTES.txt").read_text()
    (copy / "templates" / "NOTES.txt").unlink()
    (copy / "templates" / "_notes_under_test.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "\n{{- end }}\n"
    )
    (copy / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-under-test\n"
        'data:\n  notes: {{ include "test.notes" . | quote }}\n'
    )
    objects = render(helm, *sets, release=release, chart=copy)
    return str(objects["ConfigMap", "notes-under-test"]["data"]["notes"])
