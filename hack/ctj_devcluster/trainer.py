"""Kubeflow Trainer v2 (github.com/kubeflow/trainer/v2: TrainJob, TrainingRuntime,
ClusterTrainingRuntime) and JobSet (sigs.k8s.io/jobset, the workload the trainer makes of
a TrainJob), their managers built from their Go modules by hack/cluster-binaries.sh.

Unlike Kueue (kueue.py), neither runs beside the local cluster: both install on a real
cluster with their own manifests (``Stack.install_trainer``), rendered into the build:
JobSet's ``config/default``, the trainer's ``manifests/overlays/manager`` less the JobSet it
would pull from GitHub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from .binaries import find_built

if TYPE_CHECKING:
    from .cluster import Cluster


@dataclass(frozen=True, slots=True)
class ManagerBuild:
    """What hack/cluster-binaries.sh puts in a controller's cache directory: its manager,
    and its whole install (its own manifests rendered: a release's manifests.yaml)."""

    binary: Path
    manifests: Path

    @classmethod
    def find(cls, var: str, what: str, binary: str) -> ManagerBuild:
        """From ``var`` (``<dir>/bin``) or the build script's ``--check``."""
        found, manifests = find_built(var, what, f"bin/{binary}", "manifests.yaml")
        return cls(found, manifests)


def jobset_build() -> ManagerBuild:
    """JobSet's (config/default: CRDs, manager, RBAC, webhooks)."""
    return ManagerBuild.find("CTJ_JOBSET_BIN_DIR", "JobSet", "jobset")


def trainer_build() -> ManagerBuild:
    """Kubeflow Trainer's (CRDs, manager, RBAC, webhooks; no runtimes, no JobSet)."""
    return ManagerBuild.find(
        "CTJ_KUBEFLOW_TRAINER_BIN_DIR", "Kubeflow Trainer", "trainer-controller-manager"
    )


def install_trainer_crds(cluster: Cluster) -> None:
    """Only Trainer's CRDs (TrainJob, TrainingRuntime, ClusterTrainingRuntime), from its
    rendered install: enough for the API server to serve them (RBAC checks resolve a
    resource by discovery), with no manager running."""
    objects = yaml.safe_load_all(trainer_build().manifests.read_text())
    crds = [o for o in objects if o and o.get("kind") == "CustomResourceDefinition"]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump_all(crds))  # fmt: skip
    for crd in crds:
        cluster.wait_crd_established(crd["metadata"]["name"])
