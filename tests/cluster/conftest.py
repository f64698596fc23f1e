"""Fixtures for the cluster tier: one real control plane with simulated nodes for the tier.

The launcher lives in hack/ctj_devcluster (not an installed package yet: we put hack/ on
sys.path). Tests skip, with the reason, when the binaries are not built: run
hack/cluster-binaries.sh (hack/test.sh does, before pytest).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

HACK = Path(__file__).resolve().parents[2] / "hack"
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))

from ctj_devcluster import Binaries, BinariesMissing, Cluster, ClusterConfig  # noqa: E402
from ctj_devcluster.processes import wait_until  # noqa: E402

NODE_GRACE_SECONDS = 8.0
"""--node-monitor-grace-period for the session cluster: how fast a lost node is NotReady."""
GPU_RESOURCE = "example.com/gpu"


@pytest.fixture(scope="session")
def cluster_binaries() -> Binaries:
    if os.geteuid() != 0:
        pytest.skip("the node agents need root (mount and UTS namespaces per container)")
    try:
        from ctj_devcluster import find_binaries

        return find_binaries()
    except BinariesMissing as exc:
        pytest.skip(str(exc))


# package scope: stopped when the cluster tier's last test ends, not at the end of the
# session, so that an idle control plane does not share the cores with the other tiers
@pytest.fixture(scope="package")
def cluster(
    cluster_binaries: Binaries,
    tmp_path_factory: pytest.TempPathFactory,
    pytestconfig: pytest.Config,
) -> Iterator[Cluster]:
    """A running cluster: two Ready nodes (4 cpu, 8Gi, 2 example.com/gpu each)."""
    config = ClusterConfig(
        root=tmp_path_factory.mktemp("devcluster"),
        nodes=2,
        node_extended_resources={GPU_RESOURCE: "2"},
        node_monitor_grace_period=NODE_GRACE_SECONDS,
    )
    c = Cluster(config, cluster_binaries)
    c.start()
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print(
                f"\nctj devcluster: warm start {c.started_in:.1f}s "
                f"({config.nodes} nodes Ready), kubeconfig {c.kubeconfig}"
            )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace whose default service account exists (pods can be created)."""
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespace({"metadata": {"name": name}})
    wait_until(
        lambda: core.read_namespaced_service_account("default", name),
        timeout=30,
        what=f"service account default in {name}",
    )
    yield name
    core.delete_namespace(name)


# the operator tier's fixtures (3-node cluster with the CRD, the operator process)
from tests.cluster.operator_env import (  # noqa: E402, F401
    job_namespace,
    new_job,
    op_cluster,
    operator,
)
