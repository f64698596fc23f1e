"""What the operator will do: torch.distributed ranks in separate pods, on separate nodes,
finding the master by its DNS name, with the environment PyTorchJob gives."""

from __future__ import annotations

import pytest
from ctj_devcluster import Cluster

from .kube import core, exit_codes, pod_manifest, python_container, wait_pod_phase

pytestmark = pytest.mark.cluster

RANK = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("rank", dist.get_rank(), "of", dist.get_world_size(), "sum", t.item(), flush=True)
dist.destroy_process_group()
"""


def test_gloo_ranks_in_two_pods_all_reduce(cluster: Cluster, namespace: str) -> None:
    pytest.importorskip("torch")
    api = core(cluster)
    api.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "job"},
            "spec": {"clusterIP": "None", "selector": {"job": "demo"}},
        },
    )
    for rank in (0, 1):
        env = [
            {"name": "MASTER_ADDR", "value": f"job-0.job.{namespace}.svc.cluster.local"},
            {"name": "MASTER_PORT", "value": "29500"},
            {"name": "WORLD_SIZE", "value": "2"},
            {"name": "RANK", "value": str(rank)},
        ]
        pod = pod_manifest(
            f"job-{rank}",
            [python_container("trainer", RANK, env=env)],
            hostname=f"job-{rank}",
            subdomain="job",
            labels={"job": "demo"},
            # one rank per node, as the operator places them
            affinity={
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {"matchLabels": {"job": "demo"}},
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ]
                }
            },
        )
        api.create_namespaced_pod(namespace, pod)
    done = [
        wait_pod_phase(api, namespace, f"job-{r}", {"Succeeded", "Failed"}, 120) for r in (0, 1)
    ]
    logs = [cluster.container_log(namespace, f"job-{r}", "trainer") for r in (0, 1)]
    assert [exit_codes(p) for p in done] == [{"trainer": 0}, {"trainer": 0}], logs
    assert done[0]["spec"]["nodeName"] != done[1]["spec"]["nodeName"]
    for rank, log in enumerate(logs):
        assert f"rank {rank} of 2 sum 3.0" in log
        assert "Unable to resolve hostname" not in log  # gloo found its pod IP
