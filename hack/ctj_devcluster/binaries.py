"""Finding the control plane's binaries, the same way hack/cluster-binaries.sh builds them.

The build script is the single source of truth for where a given version and recipe lives
(``--check`` prints the paths and exits 3 if something is not built), so the launcher asks
it instead of recomputing cache keys. ``CTJ_ETCD_BIN_DIR``, ``CTJ_K8S_BIN_DIR`` and
``CTJ_HELM_BIN_DIR`` override it, e.g. to use binaries from elsewhere.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

HACK_DIR = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = HACK_DIR / "cluster-binaries.sh"
_DIR_VARS = ("CTJ_ETCD_BIN_DIR", "CTJ_K8S_BIN_DIR", "CTJ_HELM_BIN_DIR")


class BinariesMissing(RuntimeError):
    """The binaries are not built; the message says how to build them."""


@dataclass(frozen=True, slots=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    helm: Path

    def __post_init__(self) -> None:
        missing = [str(p) for p in self.all() if not os.access(p, os.X_OK)]
        if missing:
            raise BinariesMissing(
                f"not built or not executable: {', '.join(missing)}; run {BUILD_SCRIPT}"
            )

    def all(self) -> tuple[Path, ...]:
        return (
            self.etcd,
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kube_scheduler,
            self.kubectl,
            self.helm,
        )


def built_dirs() -> dict[str, str]:
    """KEY=PATH of every directory hack/cluster-binaries.sh builds (``--check``: nothing
    is built; a path listed may not exist yet)."""
    if not BUILD_SCRIPT.exists():
        raise BinariesMissing(f"{BUILD_SCRIPT} not found")
    proc = subprocess.run(
        [str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    # 3: something is not built; which of it matters is for the caller to say (the
    # control plane needs neither Kubeflow's controller nor SeaweedFS)
    if proc.returncode not in (0, 3):
        raise BinariesMissing(f"{BUILD_SCRIPT} --check failed: {proc.stderr.strip()}")
    dirs = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            dirs[key.strip()] = value.strip()
    return dirs


def find_binaries() -> Binaries:
    """The binaries to run, from the environment overrides or the build cache."""
    dirs = {k: os.environ[k] for k in _DIR_VARS if os.environ.get(k)}
    if len(dirs) < len(_DIR_VARS):
        dirs = {**built_dirs(), **dirs}
    etcd, k8s, helm = (Path(dirs[k]) for k in _DIR_VARS)  # Binaries checks they exist
    return Binaries(
        etcd=etcd / "etcd",
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        helm=helm / "helm",
    )


def find_built(var: str, what: str, *files: str) -> tuple[Path, ...]:
    """``files`` (relative to the cache directory: ``bin/<name>``, ``crds``, ...) of the
    build hack/cluster-binaries.sh prints as ``var`` (``<dir>/bin``; the environment's
    ``var`` first, else its ``--check``). BinariesMissing, naming ``what`` and how to build
    it, where any of them is missing."""
    bin_dir = os.environ.get(var) or built_dirs().get(var, "")
    root = Path(bin_dir).parent
    paths = tuple(root / f for f in files)
    missing = [str(p) for p in paths if not p.exists()]
    if not bin_dir or missing:
        raise BinariesMissing(
            f"{what} is not built ({', '.join(missing) or var + ' unset'}); run {BUILD_SCRIPT}"
        )
    return paths


def find_helm() -> Path:
    """helm alone (the chart's tests render with it; they need no control plane, and run
    while the test command still builds one: ``hack/cluster-binaries.sh --local``)."""
    (helm,) = find_built("CTJ_HELM_BIN_DIR", "helm", "bin/helm")
    return helm
