"""The cluster harness: what a scenario needs of a cluster that runs ctj's operator.

Two implementations:
- ``ctj_stack.stack.Stack``: a real cluster (kind in the e2e tier and the demo) with
  real kubelets, our images, the chart, the in-cluster S3 server;
- ``ctj_stack.simulated.SimulatedStack``: the simulated cluster of the cluster tier
  (ctj_devcluster: a real API server, nodes as processes on this machine), the operator
  as a process, the S3 server on loopback.

Each says how it runs kubectl, what a job's manifest is, where a container's log is and
how a node is stopped and started; everything else (reading a job back, waiting for an
attempt, finding its restore) is written once, here. A scenario written against
``Harness`` (ctj_stack.scenario) runs on both tiers.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import yaml
from ctj_contract import GROUP, KIND, LABEL_ATTEMPT, LABEL_JOB, LABEL_RANK, PLURAL, VERSION
from ctj_devcluster.processes import wait_until
from kubernetes import client

# how the Kubeflow controller labels its pods (backend pytorchjob), and the container name
# a PyTorchJob requires (a TrainJob's runtime: "node")
KF_REPLICA_TYPE = "training.kubeflow.org/replica-type"
KF_TRAINER = "pytorch"
TRAINJOB_TRAINER = "node"
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # a TrainJob pod's rank
RESTART_TIMEOUT = 420.0  # node-monitor grace + teardown + scheduling + torch's start


def trainer_log_events(text: str, attempt: int | None = None) -> list[dict[str, Any]]:
    """The JSON event lines of a trainer's log (examples/train_fsdp.py prints one per
    event); other lines, and a line still being written, are skipped. ``attempt``: only
    that attempt's (a pod kept across attempts runs one worker per attempt, one log)."""
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if attempt is None or event.get("attempt") == attempt:
                events.append(event)
    return events


class Harness(ABC):
    """One cluster running ctj's operator, as a scenario sees it. ``log`` gets one line
    per step; waits poll every ``poll_interval`` seconds."""

    poll_interval = 1.0

    def __init__(self, api_client: Any, log: Callable[[str], None] = print) -> None:
        self.api_client = api_client
        self.log = log
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    # --- what each cluster does its own way -----------------------------------------

    @abstractmethod
    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        """kubectl against this cluster; its stdout (an error names the command)."""

    @abstractmethod
    def example_job(
        self, name: str = "demo", backend: str = "pods", example: str = "job.yaml", **env: str
    ) -> dict[str, Any]:
        """examples/``example`` (job.yaml unless named) as this cluster runs it, named
        ``name``, run by ``backend``, with ``env`` set in the trainer."""

    @abstractmethod
    def container_log(self, namespace: str, pod: str, container: str) -> str | None:
        """What the container wrote, or None where there is no such log (yet)."""

    @abstractmethod
    def stop_node(self, node: str) -> None:
        """Lose the machine: no goodbye to the API server."""

    @abstractmethod
    def start_node(self, node: str) -> None:
        """Bring it back, same name."""

    @abstractmethod
    def signal_trainer(self, namespace: str, pod: str, signal: str) -> None:
        """Send ``signal`` (STOP, CONT, KILL) to the pod's trainer process, as the machine's
        owner could: a hung rank, made on purpose."""

    @abstractmethod
    def crash_operator(self) -> str:
        """SIGKILL the operator that leads, as a crash would (no hand-over of its Lease):
        a standby, or the same one started again, takes over. The leader's name."""

    def reserved_nodes(self) -> set[str]:
        """Nodes a scenario must not stop (they run what the test is not about)."""
        return set()

    # --- jobs -----------------------------------------------------------------------

    def apply(self, objects: list[dict[str, Any]], namespace: str | None = None) -> None:
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        self.kubectl(*args, stdin=yaml.safe_dump_all(objects))

    def apply_job(self, namespace: str, job: dict[str, Any]) -> None:
        self.log(f"kubectl apply -n {namespace}: an example job (name {job['metadata']['name']}, "
                 f"backend {job['spec']['backend']}, {job['spec']['replicas']} pods x "
                 f"{job['spec'].get('nprocPerNode', 1)} ranks)")  # fmt: skip
        self.apply([job], namespace)

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.log(f"kubectl scale ctj/{name} --replicas={replicas}")
        self.kubectl("scale", f"ctj/{name}", f"--replicas={replicas}", "-n", namespace)

    def suspend(self, namespace: str, name: str, suspend: bool, **spec: Any) -> None:
        """``kubectl patch`` of spec.suspend (and any other ``spec`` fields with it)."""
        patch = json.dumps({"spec": {"suspend": suspend, **spec}})
        self.log(f"kubectl patch ctj/{name} --type=merge -p '{patch}'")
        self.kubectl("patch", f"ctj/{name}", "-n", namespace, "--type=merge", "-p", patch)

    def delete_job(self, namespace: str, name: str) -> None:
        self.kubectl("delete", "ctj", name, "-n", namespace, "--wait=true", "--timeout=120s")

    # --- reading back ---------------------------------------------------------------

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        assert isinstance(obj, dict)
        return obj

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return dict(self.job(namespace, name).get("status") or {})

    def events(self, namespace: str, name: str) -> list[Any]:
        """Kubernetes Events about the job (the operator posts one per transition)."""
        return [
            e
            for e in self.core.list_namespaced_event(namespace).items
            if e.involved_object.kind == KIND and e.involved_object.name == name
        ]

    def pods(self, namespace: str, name: str) -> list[Any]:
        selector = f"{LABEL_JOB}={name}"
        return list(self.core.list_namespaced_pod(namespace, label_selector=selector).items)

    def attempt_pods(self, namespace: str, name: str, attempt: int) -> list[Any]:
        return [
            p
            for p in self.pods(namespace, name)
            if p.metadata.labels.get(LABEL_ATTEMPT) == str(attempt)
        ]

    def running(self, namespace: str, name: str, world: int) -> dict[str, Any] | None:
        """The status once an attempt runs at ``world`` with all its pods Running."""
        st = self.status(namespace, name)
        if st.get("phase") != "Running" or st.get("worldSize") != world:
            return None
        pods = self.attempt_pods(namespace, name, int(st.get("attempt", -1)))
        ok = len(pods) == world and all(p.status.phase == "Running" for p in pods)
        return st if ok else None

    def trainer_events(
        self, namespace: str, pod: str, attempt: int | None = None
    ) -> list[dict[str, Any]]:
        """The JSON lines examples/train_fsdp.py printed (none if the pod has no log yet),
        from its trainer container (named ``pytorch`` in a PyTorchJob's pods); ``attempt``:
        only that attempt's."""
        for container in ("trainer", KF_TRAINER, TRAINJOB_TRAINER):
            text = self.container_log(namespace, pod, container)
            if text is not None:
                return trainer_log_events(text, attempt)
        return []

    def wait_running(self, namespace: str, name: str, world: int, after: int) -> dict[str, Any]:
        """The status once an attempt later than ``after`` runs at ``world``."""

        def later() -> dict[str, Any] | None:
            st = self.running(namespace, name, world)
            return st if st and int(st["attempt"]) > after else None

        st: dict[str, Any] = self.wait(
            later, f"the job to run at world size {world}", RESTART_TIMEOUT,
            lambda: self.describe(namespace, name),
        )  # fmt: skip
        return st

    def master(self, namespace: str, name: str, attempt: int) -> str | None:
        """The name of ``attempt``'s rank-0 pod (the example logs from rank 0 only)."""
        for p in self.attempt_pods(namespace, name, attempt):
            labels = p.metadata.labels
            if "0" in (labels.get(LABEL_RANK), labels.get(JOB_COMPLETION_INDEX)) or (
                labels.get(KF_REPLICA_TYPE) == "master"
            ):
                return str(p.metadata.name)
        return None

    def restored(
        self, namespace: str, name: str, attempt: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Rank 0's ``restored`` event in ``attempt`` and its first step after it (every
        rank loads the step rank 0 reports)."""

        def seen() -> tuple[dict[str, Any], dict[str, Any]] | None:
            pod = self.master(namespace, name, attempt)
            if pod is None:
                return None
            events = self.trainer_events(namespace, pod, attempt)
            restored = [e for e in events if e["event"] == "restored"]
            steps = [e for e in events if e["event"] == "step"]
            return (restored[0], steps[0]) if restored and steps else None

        found: tuple[dict[str, Any], dict[str, Any]] = self.wait(
            seen, f"attempt {attempt} to restore and train", 240,
            lambda: self.describe(namespace, name),
        )  # fmt: skip
        return found

    def describe(self, namespace: str, name: str, tail: int = 15) -> str:
        """The job's status, where its pods are and the last ``tail`` lines of each of their
        containers' logs: what a timeout reports."""
        lines = [json.dumps(self.status(namespace, name), indent=1)]
        for pod in self.pods(namespace, name):
            lines.append(f"{pod.metadata.name} on {pod.spec.node_name}: {pod.status.phase}")
            for container in pod.spec.containers:
                text = self.container_log(namespace, pod.metadata.name, container.name) or ""
                last = text.splitlines()[-tail:]
                lines += [f"  [{container.name}] {line}" for line in last]
        return "\n".join(lines)

    def children(self, namespace: str, name: str) -> list[str]:
        """Every object in ``namespace`` the job owns or labels (pods, services, secrets,
        config maps, PyTorchJobs), as kind/name."""
        found = []
        if self.serves_pytorchjobs():
            listing = self.custom.list_namespaced_custom_object(
                "kubeflow.org", "v1", namespace, "pytorchjobs",
                label_selector=f"{LABEL_JOB}={name}",
            )  # fmt: skip
            found += [f"pytorchjob/{o['metadata']['name']}" for o in listing["items"]]
        listings: list[tuple[str, Callable[..., Any]]] = [
            ("pod", self.core.list_namespaced_pod),
            ("service", self.core.list_namespaced_service),
            ("secret", self.core.list_namespaced_secret),
            ("configmap", self.core.list_namespaced_config_map),
        ]
        for kind, list_fn in listings:
            for obj in list_fn(namespace).items:
                labels = obj.metadata.labels or {}
                owners = [o.name for o in obj.metadata.owner_references or [] if o.kind == KIND]
                if labels.get(LABEL_JOB) == name or name in owners:
                    found.append(f"{kind}/{obj.metadata.name}")
        return found

    def serves_pytorchjobs(self) -> bool:
        names = self.kubectl("api-resources", "--api-group=kubeflow.org", "-o", "name")
        return "pytorchjobs.kubeflow.org" in names.split()

    def trainer_container(self, namespace: str, pod: str) -> tuple[str, str]:
        """(node, container ID) of the pod's running trainer container."""
        found = self.core.read_namespaced_pod(pod, namespace)
        ids = [c.container_id for c in found.status.container_statuses or [] if c.name == "trainer"]
        if not ids or not ids[0]:
            raise RuntimeError(f"{pod} has no trainer container running")
        return str(found.spec.node_name), str(ids[0])

    # --- nodes ----------------------------------------------------------------------

    def node_of(self, pod: Any) -> str:
        return str(pod.spec.node_name)

    def victim(self, namespace: str, name: str, attempt: int) -> Any:
        """The pod of ``attempt`` whose node to stop: the highest-named one on a node that
        is not reserved (losing the operator or the S3 server is another test)."""
        keep = self.reserved_nodes()
        pods = sorted(self.attempt_pods(namespace, name, attempt), key=lambda p: p.metadata.name)
        candidates = [p for p in pods if p.spec.node_name not in keep]
        if not candidates:
            raise RuntimeError(f"every node of the job is reserved: {sorted(keep)}")
        return candidates[-1]

    def node_back(self, node: str, since: float) -> bool:
        """The node's kubelet renewed its Lease after ``since`` (a Ready condition can be
        the one from before the node stopped, until the node-monitor grace period ends)."""
        try:
            lease = client.CoordinationV1Api(self.api_client).read_namespaced_lease(
                node, "kube-node-lease"
            )
        except client.ApiException:
            return False
        renewed = lease.spec.renew_time
        return bool(renewed and renewed.timestamp() > since and self.node_ready(node))

    def node_ready(self, node: str) -> bool:
        try:
            conditions = self.core.read_node(node).status.conditions or []
        except client.ApiException:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    # --- waiting --------------------------------------------------------------------

    def wait(
        self,
        condition: Callable[[], Any],
        what: str,
        timeout: float,
        diagnostics: Callable[[], str] | None = None,
        poll: float | None = None,
    ) -> Any:
        """``condition``'s first truthy value, looked for every ``poll`` seconds (the
        cluster's poll_interval by default) for at most ``timeout``."""
        start = time.monotonic()
        result = wait_until(
            condition,
            timeout=timeout,
            what=what,
            interval=self.poll_interval if poll is None else poll,
            on_timeout=diagnostics,
        )
        self.log(f"  {what}: {time.monotonic() - start:.0f}s")
        return result
