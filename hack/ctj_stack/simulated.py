"""The cluster harness (ctj_stack.harness) on the simulated cluster of the cluster tier:
ctj_devcluster's API server and node agents, the operator run as a process beside it
(ctj_stack.jobs.OperatorProcess), the S3 server on loopback. The pods run on this
machine, so a job's trainer runs examples/ from the checkout (ctj_stack.jobs.job_manifest)."""

from __future__ import annotations

import contextlib
import os
import signal as signal_module
from collections.abc import Callable
from typing import Any

from ctj_devcluster import Cluster
from ctj_devcluster.processes import descendants

from .harness import Harness
from .jobs import EXAMPLES, OperatorProcess, job_manifest


class SimulatedStack(Harness):
    """``cluster`` with the CRD installed and ``operator`` watching it; jobs checkpoint to
    ``s3_uri`` at ``endpoint``."""

    poll_interval = 0.2  # everything is on this machine: waits can look often

    def __init__(
        self,
        cluster: Cluster,
        operator: OperatorProcess,
        s3_uri: str,
        endpoint: str,
        log: Callable[[str], None] = print,
    ) -> None:
        super().__init__(cluster.api_client(), log)
        self.cluster, self.operator = cluster, operator
        self.s3_uri, self.endpoint = s3_uri, endpoint

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return self.cluster.kubectl(*args, input=stdin, timeout=180).stdout

    def example_job(
        self, name: str = "demo", backend: str = "pods", example: str = "job.yaml", **env: str
    ) -> dict[str, Any]:
        return job_manifest(name, self.s3_uri, self.endpoint, env=env, backend=backend,
                            example=EXAMPLES / example)  # fmt: skip

    def container_log(self, namespace: str, pod: str, container: str) -> str | None:
        try:
            return self.cluster.container_log(namespace, pod, container)
        except FileNotFoundError:
            return None

    def stop_node(self, node: str) -> None:
        self.cluster.kill_node(node)

    def start_node(self, node: str) -> None:
        self.cluster.restart_node(node)

    def crash_operator(self) -> str:
        killed = f"pid {self.operator.proc.pid}"
        self.operator.kill()
        self.operator.start()  # it waits out the dead one's Lease, then leads
        return killed

    def trainer_groups(self, namespace: str, pod: str) -> list[int]:
        """The process groups of the pod's trainer container: the local cluster runs each
        container as a group and names its leader's pid in the container ID
        (``ctj://<node>/<pid>``); under the ctj launcher the worker runs in a group of its
        own, a descendant of the leader."""
        leader = int(self.trainer_container(namespace, pod)[1].rsplit("/", 1)[1])
        groups = {leader}
        for pid in descendants(leader):
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                groups.add(os.getpgid(pid))
        return sorted(groups)

    def signal_trainer(self, namespace: str, pod: str, signal: str) -> None:
        for group in self.trainer_groups(namespace, pod):
            os.killpg(group, getattr(signal_module, f"SIG{signal}"))
