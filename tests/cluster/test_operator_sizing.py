"""Sizing and refusals on a real control plane: which nodes count for a rank, what the
scheduler refuses that the capacity model does not see, what the API refuses.

The cluster here is not the shared uniform one: 2 "cpu" nodes (``pool=cpu``) and 2 "gpu"
nodes (``pool=gpu``, 2 ``nvidia.com/gpu`` each, tainted ``nvidia.com/gpu=present:
NoSchedule`` through the API as a GPU pool is). The trainers only sleep: sizing is the
point, not training; the heartbeat sidecar runs in every pod as always.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Binaries, Cluster, ClusterConfig
from ctj_stack.jobs import (
    OperatorProcess,
    core,
    create_job,
    custom,
    get_job,
    install_crd,
    job_events,
    job_manifest,
    job_pods,
    running,
    status,
    wait_for,
)
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.kube import pod_manifest

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"
CPU_NODES = ("cpu-1", "cpu-2")
GPU_NODES = ("gpu-1", "gpu-2")
TAINT = {"key": GPU, "value": "present", "effect": "NoSchedule"}
TOLERATION = {"key": GPU, "operator": "Equal", "value": "present", "effect": "NoSchedule"}
SLEEP = ["sleep", "3600"]


def _conditions(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st.get("conditions") or []}


def _taints(cluster: Cluster, node: str) -> list[dict[str, Any]]:
    taints = core(cluster).read_node(node).spec.taints or []
    return [{"key": t.key, "value": t.value, "effect": t.effect} for t in taints]


@pytest.fixture(scope="module")
def op_cluster(
    cluster_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Overrides the shared uniform cluster: 2 cpu nodes, 2 tainted gpu nodes, the CRD."""
    c = Cluster(
        ClusterConfig(
            root=tmp_path_factory.mktemp("sizing"), nodes=0, node_monitor_grace_period=8.0
        ),
        cluster_binaries,
    )
    c.start()
    try:
        for name in CPU_NODES:
            c.add_node(name, wait=False, labels={"pool": "cpu"})
        for name in GPU_NODES:
            c.add_node(name, wait=False, labels={"pool": "gpu"}, extended_resources={GPU: "2"})
        for name in c.nodes:
            c.wait_node_ready(name)
        api = core(c)
        for name in GPU_NODES:
            # the node lifecycle controller removes its not-ready taint once the node is
            # Ready: replace the list only then, so ours is the only one left
            wait_for(lambda n=name: not _taints(c, n), f"{name} without not-ready taint", 60)
            api.patch_node(name, {"spec": {"taints": [TAINT]}})
        for name in GPU_NODES:  # the agent posts only status: the taint stays
            assert _taints(c, name) == [TAINT]
            assert api.read_node(name).status.allocatable[GPU] == "2"
        install_crd(c)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def operator(
    op_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """One operator for the module (overrides the per-test one: a SIGKILLed leader's Lease
    would make each next operator stand by 15 s); each test reads its own part of the log."""
    op = OperatorProcess(op_cluster, tmp_path_factory.mktemp("sizing-op") / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.kill()


@pytest.fixture
def op_log(operator: OperatorProcess) -> Iterator[Callable[[], str]]:
    """The operator's log since the test began (printed at the end: shown on failure)."""
    start = operator.log.stat().st_size if operator.log.exists() else 0

    def since() -> str:
        with open(operator.log, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    yield since
    print("---- operator log during the test (tail) ----\n" + since()[-8000:])


Submit = Callable[..., dict[str, Any]]


@pytest.fixture
def submit(
    op_cluster: Cluster,
    operator: OperatorProcess,
    op_log: Callable[[], str],
    job_namespace: str,
    s3_uri: str,
    s3_env: dict[str, str],
) -> Submit:
    """submit(name, resources=..., pod={template pod spec fields}, **spec fields): a job
    whose trainer sleeps, created in the test's namespace with the operator up."""

    def create(
        name: str,
        *,
        resources: dict[str, Any] | None = None,
        pod: dict[str, Any] | None = None,
        **spec: Any,
    ) -> dict[str, Any]:
        job = job_manifest(name, s3_uri, s3_env["AWS_ENDPOINT_URL"], command=SLEEP, **spec)
        template = job["spec"]["template"]["spec"]
        if resources:
            template["containers"][0]["resources"] = resources
        template.update(pod or {})
        return create_job(op_cluster, job_namespace, job)

    return create


def _gpu_job(submit: Submit, name: str, *, tolerate: bool) -> dict[str, Any]:
    return submit(
        name,
        resources={"limits": {GPU: "1"}},
        pod={"tolerations": [TOLERATION]} if tolerate else {},
        replicas=4,
        minReplicas=1,
        maxReplicas=4,
    )


def _nodes_of(cluster: Cluster, ns: str, name: str, attempt: int) -> list[str]:
    pods = job_pods(cluster, ns, name)
    return sorted(
        p.spec.node_name for p in pods if p.metadata.labels[f"{GROUP}/attempt"] == str(attempt)
    )


def _kubectl_patch(cluster: Cluster, ns: str, name: str, patch: dict[str, Any]) -> Any:
    return cluster.kubectl(
        "patch", f"ctj/{name}", "-n", ns, "--type", "merge", "-p", json.dumps(patch), check=False
    )


def _samples(exposition: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample ``name`` of a /metrics body: its labels (sorted pairs) -> value."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name
    }


def _holds(condition: Callable[[], Any], what: str, seconds: float) -> None:
    """``condition`` is true at every poll for ``seconds`` (an invariant over a window,
    e.g. several reconcile ticks with nothing retried)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert condition(), f"no longer true: {what}"
        time.sleep(0.2)


# ---------------------------------------------------------------- 1, 2: GPU pool


def test_a_gpu_job_counts_only_the_gpu_nodes_it_tolerates(
    op_cluster: Cluster, job_namespace: str, submit: Submit
) -> None:
    ns, name = job_namespace, "gpu"
    _gpu_job(submit, name, tolerate=True)
    st = wait_for(lambda: running(op_cluster, ns, name, 1, 2), "attempt 1 at world size 2", 120)
    assert st["worldSize"] == 2, "replicas 4, but only the 2 gpu nodes have a free GPU"
    assert _conditions(st)["Running"]["message"] == "attempt 1 at world size 2"
    assert _nodes_of(op_cluster, ns, name, 1) == list(GPU_NODES)
    pod = core(op_cluster).read_namespaced_pod(f"{name}-a1-0", ns)
    assert pod.spec.containers[0].resources.requests[GPU] == "1"


def test_a_gpu_job_without_the_toleration_waits_naming_the_taint_until_it_tolerates_it(
    op_cluster: Cluster, job_namespace: str, submit: Submit
) -> None:
    ns, name = job_namespace, "untolerated"
    _gpu_job(submit, name, tolerate=False)

    def waiting() -> dict[str, Any] | None:
        st = status(op_cluster, ns, name)
        queued = _conditions(st).get("Queued") or {}
        ok = queued.get("status") == "True" and queued.get("reason") == "InsufficientNodes"
        return queued if ok else None

    cond = wait_for(waiting, "Queued/InsufficientNodes", 60)
    message = cond["message"]
    assert "0 nodes can run a rank; the job needs at least 1" in message, message
    assert "taint nvidia.com/gpu=present:NoSchedule not tolerated" in message, message
    assert "gpu-1" in message and "gpu-2" in message, message
    assert "insufficient nvidia.com/gpu" in message, message  # why the cpu nodes do not count
    st = status(op_cluster, ns, name)
    assert st.get("phase") == "Pending" and not st.get("attempt")
    assert not job_pods(op_cluster, ns, name)
    assert "InsufficientNodes" in {e.reason for e in job_events(op_cluster, ns, name)}

    patched = _kubectl_patch(
        op_cluster, ns, name, {"spec": {"template": {"spec": {"tolerations": [TOLERATION]}}}}
    )
    assert patched.returncode == 0, patched.stderr
    st = wait_for(lambda: running(op_cluster, ns, name, 1, 2), "attempt 1 at world size 2", 120)
    assert _nodes_of(op_cluster, ns, name, 1) == list(GPU_NODES)
    assert _conditions(st)["Running"]["reason"] == "Started"


# ---------------------------------------------------------------- 3: room taken by others


def test_a_cpu_job_counts_only_the_cpu_node_another_pod_left_room_on(
    op_cluster: Cluster, job_namespace: str, submit: Submit
) -> None:
    ns, name = job_namespace, "cpu"
    api = core(op_cluster)
    blocker = pod_manifest(
        "blocker",
        [
            {
                "name": "main",
                "image": "busybox",
                "command": SLEEP,
                "resources": {"requests": {"memory": "6Gi"}},
            }
        ],
        nodeSelector={"kubernetes.io/hostname": "cpu-1"},
    )
    api.create_namespaced_pod(ns, blocker)
    wait_for(
        lambda: (
            (p := api.read_namespaced_pod("blocker", ns)).spec.node_name == "cpu-1"
            and p.status.phase == "Running"
        ),
        "the blocker running on cpu-1",
        60,
    )
    submit(
        name,
        resources={"requests": {"memory": "4Gi"}},  # 2Gi left on cpu-1, 8Gi on cpu-2
        pod={"nodeSelector": {"pool": "cpu"}},
        replicas=2,
        minReplicas=1,
        maxReplicas=2,
    )
    st = wait_for(lambda: running(op_cluster, ns, name, 1, 1), "attempt 1 at world size 1", 120)
    assert st["worldSize"] == 1
    assert _nodes_of(op_cluster, ns, name, 1) == ["cpu-2"]


# ---------------------------------------------------------------- 4: the scheduler says no


def test_ranks_the_scheduler_cannot_place_end_the_attempt_as_unschedulable(
    op_cluster: Cluster, job_namespace: str, submit: Submit
) -> None:
    """A required podAffinity to a label no pod has: the capacity model does not look at
    inter-pod affinity (docs/sizing.md, "not modelled"), the scheduler does."""
    ns, name = job_namespace, "affine"
    affinity = {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"ctj-test/nobody": "here"}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    submit(
        name,
        pod={"nodeSelector": {"pool": "cpu"}, "affinity": affinity},
        replicas=2,
        minReplicas=1,
        maxReplicas=2,
        failureDetection={"schedulingTimeoutSeconds": 10},
    )
    st = wait_for(
        lambda: (
            (s := status(op_cluster, ns, name)).get("attempt") == 1 and s.get("podsCreated") and s
        ),
        "attempt 1 created",
        60,
    )
    assert st["worldSize"] == 2, "both cpu nodes count: pod affinity is not modelled"

    def restarted() -> dict[str, Any] | None:
        st = status(op_cluster, ns, name)
        return st if _conditions(st).get("Restarted") else None

    st = wait_for(restarted, "attempt 1 to end", 90)
    cond = _conditions(st)["Restarted"]
    assert cond["reason"] == "Unschedulable", cond
    message = cond["message"]
    assert "2 of 2 ranks not running after 10s" in message, message
    assert "schedulingTimeoutSeconds" in message and f"pod {name}-a1-0" in message, message
    assert "didn't match pod affinity rules" in message, message  # the scheduler's words
    assert st["nodeRestarts"] >= 1 and st.get("restarts", 0) == 0, st
    # the next attempt is capped at the ranks that got a node (none), at least minReplicas
    st = wait_for(
        lambda: (s := status(op_cluster, ns, name)).get("attempt", 0) >= 2 and s, "attempt 2", 60
    )
    assert st["worldSize"] == 1 and st.get("restarts", 0) == 0, st
    assert "Unschedulable" in {e.reason for e in job_events(op_cluster, ns, name)}


# ---------------------------------------------------------------- 5: the API says no


def test_a_pod_over_quota_fails_the_attempt_then_the_job_never_retrying_silently(
    op_cluster: Cluster,
    operator: OperatorProcess,
    op_log: Callable[[], str],
    job_namespace: str,
    submit: Submit,
) -> None:
    ns, name = job_namespace, "overquota"
    api = core(op_cluster)
    # earlier tests' jobs go with their namespaces; until they are gone, their attempts
    # may end too (a terminating namespace refuses new pods): count from a quiet cluster
    wait_for(
        lambda: (
            not [
                j
                for j in custom(op_cluster).list_cluster_custom_object(GROUP, VERSION, PLURAL)[
                    "items"
                ]
                if j["metadata"]["namespace"] != ns
            ]
        ),
        "no other job left in the cluster",
        120,
    )
    rejected = (("cause", "crash"), ("reason", "PodRejected"))
    before = _samples(operator.metrics(), "ctj_job_restarts_total").get(rejected, 0)
    api.create_namespaced_resource_quota(
        ns, {"metadata": {"name": "one-pod"}, "spec": {"hard": {"pods": "1"}}}
    )
    # admission refuses every pod while the quota has no status yet
    wait_for(
        lambda: (api.read_namespaced_resource_quota("one-pod", ns).status.hard or {}).get("pods"),
        "the quota's status",
        60,
    )
    submit(
        name,
        pod={"nodeSelector": {"pool": "cpu"}},
        replicas=2,
        minReplicas=1,
        maxReplicas=2,
        restartPolicy={"maxRestarts": 1, "backoffSeconds": 0.5},
    )
    st = wait_for(
        lambda: (s := status(op_cluster, ns, name)).get("phase") == "Failed" and s,
        "the job to fail",
        120,
    )
    conds = _conditions(st)
    assert st["attempt"] == 2 and st["restarts"] == 1, st
    assert conds["Restarted"]["reason"] == "PodRejected", conds
    assert "the API rejected a pod" in conds["Restarted"]["message"], conds
    assert "exceeded quota: one-pod" in conds["Restarted"]["message"], conds
    assert conds["Failed"]["reason"] == "MaxRestartsExceeded", conds
    assert "exceeded quota: one-pod" in conds["Failed"]["message"], conds
    assert "spec.restartPolicy.maxRestarts=1" in conds["Failed"]["message"], conds
    wait_for(
        lambda: (
            {"PodRejected", "MaxRestartsExceeded"}
            <= {e.reason for e in job_events(op_cluster, ns, name)}
        ),
        "the PodRejected and MaxRestartsExceeded Events",
        30,
    )

    def rejections() -> tuple[int, int]:
        """(rejections that ended an attempt, rejections whose status write lost a race
        (409: the plan is dropped and the next tick decides again))."""
        lines = re.findall(rf"ctj\.operator: {ns}/{name}\b.*", op_log())
        counted = lost = 0
        for line, after in zip(lines, [*lines[1:], ""], strict=True):
            if ": the attempt's objects were rejected: " in line:
                assert "exceeded quota: one-pod" in line, line
                if "the job changed since it was read" in after:
                    lost += 1
                else:
                    counted += 1
        return counted, lost

    counted, lost = rejections()
    assert counted == 2 and lost <= 2, (counted, lost)  # one per attempt, no loop
    # and it stays failed: for several reconcile ticks, no attempt 3, no rejection retried
    _holds(
        lambda: status(op_cluster, ns, name)["attempt"] == 2 and rejections() == (counted, lost),
        "the failed job stays at attempt 2, rejected no more",
        5,
    )
    assert "Traceback" not in op_log(), op_log()[-4000:]
    exposition = operator.metrics()
    restarts = _samples(exposition, "ctj_job_restarts_total")
    assert restarts.get(rejected, 0) - before == 1, restarts  # attempt 1; 2 failed the job
    # a failed job holds no node: the pod created just before the rejected one goes too
    wait_for(
        lambda: not job_pods(op_cluster, ns, name),
        "the failed job's pods removed (left: "
        + ", ".join(f"{p.metadata.name} {p.status.phase}" for p in job_pods(op_cluster, ns, name))
        + ")",
        60,
    )


def test_an_attempt_resumed_under_a_quota_its_own_pods_fill_is_not_rejected(
    op_cluster: Cluster, job_namespace: str, submit: Submit
) -> None:
    """An operator killed after creating every pod of an attempt, before writing
    ``podsCreated: true``, creates the attempt again and ignores the 409s (docs/operator.md,
    "Status before objects"). Under a quota the job's own pods fill, the API answers that
    re-create with a 403 "exceeded quota" (quota admission runs before the name is looked
    up), which is no rejection: every pod exists."""
    ns, name = job_namespace, "resumed"
    api = core(op_cluster)
    api.create_namespaced_resource_quota(
        ns, {"metadata": {"name": "two-pods"}, "spec": {"hard": {"pods": "2"}}}
    )
    wait_for(
        lambda: (api.read_namespaced_resource_quota("two-pods", ns).status.hard or {}).get("pods"),
        "the quota's status",
        60,
    )
    submit(
        name,
        pod={"nodeSelector": {"pool": "cpu"}},
        replicas=2,
        minReplicas=1,
        maxReplicas=2,
        restartPolicy={"maxRestarts": 3, "backoffSeconds": 0.5},
    )

    def started_or_ended() -> dict[str, Any] | None:
        st = status(op_cluster, ns, name)
        return st if _conditions(st).get("Restarted") else running(op_cluster, ns, name, 1, 2)

    # even unkilled, the operator takes that path when kopf's own first patch of the job
    # (its finalizer) makes the podsCreated write a 409
    st = wait_for(started_or_ended, "attempt 1 at world size 2 (or its end)", 120)
    assert not _conditions(st).get("Restarted"), _conditions(st)["Restarted"]
    wait_for(
        lambda: (
            (api.read_namespaced_resource_quota("two-pods", ns).status.used or {}).get("pods")
            == "2"
        ),
        "the quota full with the attempt's 2 pods",
        60,
    )
    # the status such an operator leaves, written for it (as test_operator_idempotence does)
    custom(op_cluster).patch_namespaced_custom_object_status(
        GROUP, VERSION, ns, PLURAL, name, {"status": {"podsCreated": False}}
    )
    st = wait_for(
        lambda: (
            (
                (s := status(op_cluster, ns, name)).get("podsCreated")
                or _conditions(s).get("Restarted")
            )
            and s
        ),
        "the operator to finish creating attempt 1 (or end it)",
        60,
    )
    assert not _conditions(st).get("Restarted"), _conditions(st)["Restarted"]
    assert (st["attempt"], st.get("restarts", 0)) == (1, 0), st
    assert running(op_cluster, ns, name, 1, 2)


# ---------------------------------------------------------------- 6: the CRD's CEL rules


def test_the_checkpoint_location_is_pinned_and_the_credentials_may_rotate(
    op_cluster: Cluster, job_namespace: str, submit: Submit, s3_uri: str, s3_env: dict[str, str]
) -> None:
    ns, name = job_namespace, "pinned"
    api = core(op_cluster)
    api.create_namespaced_secret(
        ns,
        {
            "metadata": {"name": "s3-credentials-rotated"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": s3_env["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": s3_env["AWS_SECRET_ACCESS_KEY"],
            },
        },
    )
    job = submit(name, pod={"nodeSelector": {"pool": "cpu"}}, replicas=1, minReplicas=1)
    uid = job["metadata"]["uid"]
    st = wait_for(lambda: running(op_cluster, ns, name, 1, 1), "attempt 1 at world size 1", 120)
    pinned = f"{s3_uri}/{ns}/{name}-{uid}"
    assert st["storage"] == {"uri": pinned}

    def env_of(pod: str) -> dict[str, Any]:
        spec = api.read_namespaced_pod(pod, ns).spec
        sidecar = next(c for c in spec.init_containers if c.name == "ctj-sidecar")
        return {e.name: e for e in sidecar.env}

    assert env_of(f"{name}-a1-0")["CTJ_CHECKPOINT_URI"].value == pinned

    for patch, field in [
        ({"uri": "s3://elsewhere/jobs"}, "spec.checkpoint.uri"),
        ({"endpoint": "http://other-s3:9000"}, "spec.checkpoint.endpoint"),
        ({"endpoint": None}, "spec.checkpoint.endpoint"),  # removing it is a change too
    ]:
        refused = _kubectl_patch(op_cluster, ns, name, {"spec": {"checkpoint": patch}})
        assert refused.returncode != 0, f"{patch} was accepted"
        assert field in refused.stderr and "cannot change" in refused.stderr, refused.stderr
    spec = get_job(op_cluster, ns, name)["spec"]["checkpoint"]
    assert spec["uri"] == s3_uri and spec["endpoint"] == s3_env["AWS_ENDPOINT_URL"]

    rotated = _kubectl_patch(
        op_cluster,
        ns,
        name,
        {"spec": {"checkpoint": {"credentialsSecret": "s3-credentials-rotated"}}},
    )
    assert rotated.returncode == 0, rotated.stderr
    assert status(op_cluster, ns, name)["storage"] == {"uri": pinned}
    # the running attempt keeps its secret; the next one gets the rotated one
    key = env_of(f"{name}-a1-0")["AWS_ACCESS_KEY_ID"]
    assert key.value_from.secret_key_ref.name == "s3-credentials"
    api.delete_namespaced_pod(f"{name}-a1-0", ns)
    st = wait_for(lambda: running(op_cluster, ns, name, 2, 1), "attempt 2 at world size 1", 120)
    assert _conditions(st)["Restarted"]["reason"] == "PodDeleted"
    assert st["storage"] == {"uri": pinned}
    env = env_of(f"{name}-a2-0")
    assert env["CTJ_CHECKPOINT_URI"].value == pinned
    assert env["AWS_ACCESS_KEY_ID"].value_from.secret_key_ref.name == "s3-credentials-rotated"


# ---------------------------------------------------------------- 7: metrics


def test_a_deleted_job_leaves_no_world_size_series(
    op_cluster: Cluster, operator: OperatorProcess, job_namespace: str, submit: Submit
) -> None:
    ns, name = job_namespace, f"metered-{uuid.uuid4().hex[:4]}"
    submit(name, pod={"nodeSelector": {"pool": "cpu"}}, replicas=2, minReplicas=1, maxReplicas=2)
    wait_for(lambda: running(op_cluster, ns, name, 1, 2), "attempt 1 at world size 2", 120)
    series = (("job_name", name), ("namespace", ns))
    assert _samples(operator.metrics(), "ctj_job_world_size").get(series) == 2

    custom(op_cluster).delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)

    def gone() -> bool:
        try:
            get_job(op_cluster, ns, name)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    wait_for(gone, "the job gone (the operator removed its finalizer)", 60)
    wait_for(
        lambda: series not in _samples(operator.metrics(), "ctj_job_world_size"),
        "no ctj_job_world_size series for the deleted job",
        30,
    )
    assert f'job_name="{name}"' not in operator.metrics()
