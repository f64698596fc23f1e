"""The launcher starts fast from cached binaries and leaves nothing behind, even when the
process that started the cluster is killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ctj_devcluster import Binaries, Cluster, ClusterConfig
from ctj_devcluster.processes import wait_until
from kubernetes import client

from .conftest import HACK

pytestmark = pytest.mark.cluster

WARM_START_BUDGET_SECONDS = 60.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_session_cluster_started_within_budget(cluster: Cluster) -> None:
    print(f"warm cluster start: {cluster.started_in:.1f}s")
    assert 0 < cluster.started_in < WARM_START_BUDGET_SECONDS


def test_stop_leaves_no_process_and_no_memory(cluster_binaries: Binaries, tmp_path: Path) -> None:
    small = Cluster(ClusterConfig(root=tmp_path / "c", nodes=1), cluster_binaries).start()
    pids = [p.pid for p in small.control_plane.processes]
    pids += [small.dns.pid] if small.dns else []
    pids += [h.process.pid for h in small.nodes.values()]
    assert all(_alive(pid) for pid in pids)
    # a pod holding a memory-backed emptyDir on a node that is then lost: nobody on the
    # node cleans it, the launcher's teardown must
    core = client.CoreV1Api(small.api_client())
    wait_until(
        lambda: core.read_namespaced_service_account("default", "default"),
        timeout=30,
        what="default service account",
    )
    code = "open('/mnt/ctj-test/mem/blob', 'wb').write(b'x' * 2**20); import signal; signal.pause()"
    core.create_namespaced_pod(
        "default",
        {
            "metadata": {"name": "holder"},
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": "none",
                        "command": ["python", "-c", code],
                        "volumeMounts": [{"name": "mem", "mountPath": "/mnt/ctj-test/mem"}],
                    }
                ],
                "volumes": [{"name": "mem", "emptyDir": {"medium": "Memory"}}],
            },
        },
    )
    wait_until(
        lambda: any(small.shm_root.glob("*/mem/blob")), timeout=30, what="the pod's tmpfs file"
    )
    small.kill_node("node-1")
    small.stop()
    assert [pid for pid in pids if _alive(pid)] == []
    assert not small.shm_root.exists()


def test_sigkill_of_the_supervisor_kills_every_component(
    cluster_binaries: Binaries, tmp_path: Path
) -> None:
    root = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": f"{HACK}:{os.environ.get('PYTHONPATH', '')}"}
    up = subprocess.run(
        [sys.executable, "-m", "ctj_devcluster", "up", f"--dir={root}", "--nodes=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"export KUBECONFIG={root}/admin.kubeconfig" in up.stdout
    state = json.loads((root / "state.json").read_text())
    supervisor, children = state["pid"], list(state["pids"].values())
    assert len(children) >= 6  # etcd, apiserver, controller-manager, scheduler, dns, node
    status = subprocess.run(
        [sys.executable, "-m", "ctj_devcluster", "status", f"--dir={root}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0 and "node-1" in status.stdout, status.stdout + status.stderr

    t0 = time.monotonic()
    os.kill(supervisor, signal.SIGKILL)
    wait_until(
        lambda: not any(_alive(p) for p in [supervisor, *children]),
        timeout=10,
        what="every component to die with its supervisor",
    )
    print(f"all components gone {time.monotonic() - t0:.2f}s after SIGKILL")
    down = subprocess.run(
        [sys.executable, "-m", "ctj_devcluster", "down", f"--dir={root}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "not running" in down.stdout
