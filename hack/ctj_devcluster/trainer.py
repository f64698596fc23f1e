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

from .binaries import find_built


@dataclass(frozen=True, slots=True)
class JobSetBuild:
    """What hack/cluster-binaries.sh puts in JobSet's cache directory."""

    binary: Path
    manifests: Path
    """JobSet's whole install (config/default rendered: a release's manifests.yaml)."""

    @classmethod
    def find(cls) -> JobSetBuild:
        """From ``CTJ_JOBSET_BIN_DIR`` or the build script's ``--check``."""
        binary, manifests = find_built("CTJ_JOBSET_BIN_DIR", "JobSet", "bin/jobset",
                                       "manifests.yaml")  # fmt: skip
        return cls(binary, manifests)


@dataclass(frozen=True, slots=True)
class TrainerBuild:
    """What hack/cluster-binaries.sh puts in Kubeflow Trainer's cache directory."""

    binary: Path
    manifests: Path
    """The trainer's install (CRDs, manager, RBAC, webhooks; no runtimes, no JobSet)."""

    @classmethod
    def find(cls) -> TrainerBuild:
        """From ``CTJ_KUBEFLOW_TRAINER_BIN_DIR`` or the build script's ``--check``."""
        binary, manifests = find_built(
            "CTJ_KUBEFLOW_TRAINER_BIN_DIR", "Kubeflow Trainer",
            "bin/trainer-controller-manager", "manifests.yaml",
        )  # fmt: skip
        return cls(binary, manifests)
