"""Our operator and its jobs on a development cluster: the operator as a process (killable),
job manifests that run examples/train_fsdp.py, and reads of what the jobs did.

The cluster tier's fixtures (tests/cluster/operator_env.py) and the operator benchmarks
(bench/bench_recovery.py, bench/bench_operator_requests.py) share these.
"""

from __future__ import annotations

import copy
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Cluster
from ctj_devcluster.ports import retry_on_bind_conflict
from kubernetes import client, watch

from .harness import trainer_log_events
from .stack import ROOT

CRD = ROOT / "crds" / "training.ctj.dev_checkpointedtrainingjobs.yaml"
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "job.yaml"


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.1)


def install_crd(cluster: Cluster) -> None:
    """Apply crds/ and wait until the API server serves the kind."""
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.wait_crd_established(f"{PLURAL}.{GROUP}")


def job_key_file(cluster: Cluster) -> Path:
    """The cluster's key every job's token is derived from (the chart's Secret on a real
    cluster): one per cluster, so an operator restarted, or a second replica, derives the
    same tokens as the first."""
    path = Path(cluster.config.root) / "ctj-job-key"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path


class OperatorProcess:
    """`python -m ctj_operator` against the cluster, its log in a file."""

    def __init__(
        self,
        cluster: Cluster,
        log: Path,
        kubeconfig: Path | None = None,
        extra_args: tuple[str, ...] = (),
        lease: str | None = None,
    ) -> None:
        """``lease``: the leader-election Lease; replicas that share one elect a leader.
        By default each process has its own (it leads at once: a test does not wait out
        the previous test's killed operator's Lease)."""
        self.cluster, self.log = cluster, log
        self.kubeconfig = kubeconfig or cluster.kubeconfig
        self.lease = lease or f"ctj-operator-{uuid.uuid4().hex[:8]}"
        key = job_key_file(cluster)
        self.extra_args = ("--leader-election-name", self.lease, "--job-key-file", str(key),
                           *extra_args)  # fmt: skip
        self.metrics_port = self.liveness_port = 0
        self.proc: Any = None

    def start(self) -> None:
        """Starts it and returns once its ports listen (a standby's too), on ports that are
        chosen again if someone took them first (no bind race)."""

        def launch(ports: tuple[int, ...]) -> subprocess.Popen[bytes]:
            with open(self.log, "ab") as err:
                return subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ctj_operator",
                        "--kubeconfig",
                        str(self.kubeconfig),
                        "--metrics-port",
                        str(ports[0]),
                        "--liveness-port",
                        str(ports[1]),
                        *self.extra_args,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    cwd=ROOT,
                    env=dict(os.environ),
                )

        self.proc, (self.metrics_port, self.liveness_port) = retry_on_bind_conflict(
            launch, ports=2, what="ctj_operator", log=self.log, timeout=60
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            return r.read().decode()


NODE_AGENT = ("--node-agent-port", "9403")
"""The operator's flag where the chart installs node agents (their hostPort, its default)."""


FAST_TRAINING = {"CTJ_TOTAL_STEPS": "2000", "CTJ_STEP_DELAY_S": "0.1"}
"""A checkpoint every 10 steps, about one a second, and no end within a test."""


def job_manifest(
    name: str,
    s3_uri: str,
    endpoint: str,
    *,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    example: Path = EXAMPLE,
    preload: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """``example`` (examples/job.yaml) as a user would adapt it: their bucket, endpoint,
    and image.

    The simulated nodes run commands on this machine, so the image's /app is ROOT.
    ``env`` overrides the trainer's variables, ``command`` its command; ``preload`` keeps
    the example's CTJ_PRELOAD (the launcher's standby; off: the local cluster runs every
    pod on this machine); other keyword arguments replace top-level spec fields.
    """
    job = copy.deepcopy(yaml.safe_load(example.read_text()))
    job["metadata"]["name"] = name
    job["spec"]["checkpoint"].update(uri=s3_uri, endpoint=endpoint)
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    trainer["workingDir"] = str(ROOT)
    if not preload:  # a standby per pod: more Python processes than 2 cores want
        trainer["env"] = [e for e in trainer.get("env") or [] if e["name"] != "CTJ_PRELOAD"]
    if env:
        kept = [e for e in trainer.get("env") or [] if e["name"] not in env]
        trainer["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]
    if command:
        trainer["command"] = command
    for key, value in overrides.items():
        job["spec"][key] = value
    return job


NewJob = Callable[..., dict[str, Any]]
"""new_job(name, **job_manifest's keywords): the created job."""


def custom(cluster: Cluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster.api_client())


def get_job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return custom(cluster).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return get_job(cluster, namespace, name).get("status") or {}


def wait_for_status(
    cluster: Cluster,
    namespace: str,
    name: str,
    condition: Callable[[dict[str, Any]], bool],
    what: str,
    since: str,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """The first status the job was written with after resourceVersion ``since`` that
    ``condition`` holds for. A watch, not a poll: it sees every write, so a phase the
    operator holds for a few milliseconds is not missed."""
    deadline = time.monotonic() + timeout
    version = since
    while (left := deadline - time.monotonic()) > 0:
        stream = watch.Watch()
        events = stream.stream(
            custom(cluster).list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            field_selector=f"metadata.name={name}",
            resource_version=version,
            timeout_seconds=max(1, int(left)),
        )
        for event in events:
            job = event["object"]
            assert event["type"] != "ERROR", f"watching {name} for {what}: {job}"
            version = job["metadata"]["resourceVersion"]
            st = job.get("status") or {}
            if condition(st):
                stream.stop()
                return st
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def create_job(cluster: Cluster, namespace: str, job: dict[str, Any]) -> dict[str, Any]:
    return custom(cluster).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)


def core(cluster: Cluster) -> client.CoreV1Api:
    return client.CoreV1Api(cluster.api_client())


def job_pods(cluster: Cluster, namespace: str, name: str) -> list[Any]:
    return (
        core(cluster)
        .list_namespaced_pod(namespace, label_selector=f"{GROUP}/job-name={name}")
        .items
    )


def attempt_of(pod: Any) -> int:
    return int(pod.metadata.labels[f"{GROUP}/attempt"])


def running(cluster: Cluster, namespace: str, name: str, attempt: int, world: int) -> Any:
    """The status once attempt ``attempt`` runs at ``world`` with all its pods Running."""
    st = status(cluster, namespace, name)
    if not (
        st.get("phase") == "Running"
        and st.get("attempt") == attempt
        and st.get("worldSize") == world
        and st.get("podsCreated")
    ):
        return None
    pods = [p for p in job_pods(cluster, namespace, name) if attempt_of(p) == attempt]
    ok = len(pods) == world and all(p.status.phase == "Running" for p in pods)
    return st if ok else None


def print_pod_logs(cluster: Cluster, namespace: str, tail: int = 3000) -> None:
    """The end of every container log of the namespace's pods (each run's, appended)."""
    for pod in core(cluster).list_namespaced_pod(namespace).items:
        for container in [c.name for c in pod.spec.init_containers or []] + [
            c.name for c in pod.spec.containers
        ]:
            try:
                text = cluster.container_log(namespace, pod.metadata.name, container)
            except FileNotFoundError:
                continue
            print(f"---- {pod.metadata.name}/{container} (tail) ----\n{text[-tail:]}")


def trainer_events(
    cluster: Cluster,
    namespace: str,
    pod: str,
    container: str = "trainer",
    attempt: int | None = None,
) -> list[dict[str, Any]]:
    """The JSON events examples/train_fsdp.py printed in a pod's trainer container
    (``pytorch`` in a PyTorchJob's pods); ``attempt``: only that attempt's."""
    try:
        text = cluster.container_log(namespace, pod, container)
    except FileNotFoundError:
        return []
    return trainer_log_events(text, attempt)


def rank_pod(cluster: Cluster, namespace: str, name: str, attempt: int, rank: int) -> Any:
    """The pod holding node rank ``rank`` of ``attempt`` by its labels (a pod kept from
    an earlier attempt is named after that one), or None."""
    return next(
        (
            p
            for p in job_pods(cluster, namespace, name)
            if attempt_of(p) == attempt and p.metadata.labels.get(f"{GROUP}/node-rank") == str(rank)
        ),
        None,
    )


def rank0_events(
    cluster: Cluster, namespace: str, name: str, attempt: int, max_ranks: int = 8
) -> list[dict[str, Any]]:
    """What ``attempt``'s rank 0 printed (only rank 0 prints), its pod gone or not: the
    pod is one an attempt up to it made (``<name>-a<k>-<r>``), the one whose log has
    events of ``attempt``; [] while none has."""
    live = rank_pod(cluster, namespace, name, attempt, 0)
    names = [live.metadata.name] if live is not None else []
    names += [f"{name}-a{k}-{r}" for k in range(attempt, 0, -1) for r in range(max_ranks)]
    for pod in names:
        events = trainer_events(cluster, namespace, pod, attempt=attempt)
        if events:
            return events
    return []


def wait_resumed(
    cluster: Cluster, namespace: str, pod: str, container: str = "trainer", timeout: float = 90
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The trainer's first ``restored`` event and its steps, once three steps follow it."""

    def seen() -> Any:
        events = trainer_events(cluster, namespace, pod, container)
        restored = [e for e in events if e["event"] == "restored"]
        steps = [e for e in events if e["event"] == "step"]
        return restored and len(steps) >= 3 and (restored[0], steps)

    restored, steps = wait_for(seen, f"{pod} to restore and train", timeout)
    return restored, steps


def committed_steps(
    cluster: Cluster, namespace: str, pod: str, container: str = "trainer"
) -> list[int]:
    events = trainer_events(cluster, namespace, pod, container)
    return [e["step"] for e in events if e["event"] == "committed"]


def job_events(cluster: Cluster, namespace: str, name: str) -> list[Any]:
    """Kubernetes Events about the job (kopf posts one per transition)."""
    return [
        e
        for e in core(cluster).list_namespaced_event(namespace).items
        if e.involved_object.kind == "CheckpointedTrainingJob" and e.involved_object.name == name
    ]


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition, its labels matched in any order (the
    client writes them sorted); 0.0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0
