"""The CRD against the real API server: what it refuses at apply, what it lets change, the
status the operator writes and what kubectl reads of it.

Create, update and status calls only, on a control plane with no nodes: no trainer pod
runs. The operator's own code makes the status writes (its decisions, rendered and
applied by apply.py through its real API client), so what `kubectl wait` and the scale
subresource read here is what a running operator writes.
"""

from __future__ import annotations

import copy
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Binaries, Cluster, ClusterConfig
from ctj_operator.apply import Api, Outcome, apply
from ctj_operator.conditions import written
from ctj_operator.decisions import (
    DeleteJob,
    Observation,
    PatchStatus,
    Plan,
    PodView,
    decide,
    job_state,
)
from ctj_operator.observe import job_selector
from ctj_operator.render import Target, render_plan
from ctj_operator.spec import JobSpec
from ctj_stack import crd_schema
from ctj_stack.jobs import create_job, custom, get_job, install_crd, job_manifest, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def api_cluster(
    cluster_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """op_cluster's control plane and CRD, without nodes: nothing here runs a pod."""
    c = Cluster(
        ClusterConfig(root=tmp_path_factory.mktemp("apicluster"), nodes=0), cluster_binaries
    )
    c.start()
    try:
        install_crd(c)  # kubectl apply (client side): the CRD fits its annotation
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def ns(api_cluster: Cluster) -> str:
    name = f"api-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api_cluster.api_client()).create_namespace({"metadata": {"name": name}})
    return name


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    job = job_manifest(name, "s3://bucket/jobs", "http://s3:9000")
    job["spec"].update(spec)
    return job


def refusal(call: Any) -> str:
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status == 422, refused.value.body
    return str(refused.value.body)


def patch(cluster: Cluster, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    return custom(cluster).patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, body)


def test_the_crd_is_what_this_api_servers_openapi_generates(api_cluster: Cluster) -> None:
    """hack/crd-schema.sh --check against the cluster tier's kube-apiserver: the pod
    template in the CRD is Kubernetes' own, as this server publishes it."""
    assert crd_schema.main(["--kubeconfig", str(api_cluster.kubeconfig), "--check"]) == 0


def test_a_job_is_stored_with_its_pod_template_whole(api_cluster: Cluster, ns: str) -> None:
    job = manifest("whole")
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    trainer.update(
        resources={"limits": {"cpu": 2, "memory": "1Gi", "example.com/gpu": "1"}},
        ports=[{"containerPort": 29500}],
        securityContext={"runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    )
    job["spec"]["template"]["metadata"] = {"labels": {"team": "ml"}}
    job["spec"]["template"]["spec"]["tolerations"] = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    stored = create_job(api_cluster, ns, copy.deepcopy(job))
    kept = stored["spec"]["template"]
    assert kept["metadata"] == {"labels": {"team": "ml"}}
    assert kept["spec"]["tolerations"] == job["spec"]["template"]["spec"]["tolerations"]
    got = kept["spec"]["containers"][0]
    assert got["resources"] == trainer["resources"] and got["env"] == trainer["env"]
    assert got["securityContext"] == trainer["securityContext"]
    assert got["ports"] == [{"containerPort": 29500, "protocol": "TCP"}]  # the list-map key


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param(
            {"failureDetection": {"heartbeatPeriodSeconds": 2, "heartbeatTimeoutSeconds": 5}},
            "spec.failureDetection.heartbeatTimeoutSeconds must be at least 3 x",
            id="heartbeat-timeout-under-3-periods",
        ),
        pytest.param(
            {"failureDetection": {"heartbeatPeriodSeconds": 4}},
            "spec.failureDetection.heartbeatTimeoutSeconds must be at least 3 x",
            id="period-raised-past-the-default-timeout",
        ),
        pytest.param(
            {"template": {"spec": {"containers": []}}},
            "spec.template.spec.containers is empty: add the trainer container",
            id="no-container",
        ),
        pytest.param(
            {"template": {"metadata": {"labels": {"a": "b"}}}},
            "spec.template.spec: Required value",
            id="no-pod-spec",
        ),
        pytest.param(
            {"template": {"spec": {"containers": [{"image": "x"}]}}},
            "spec.template.spec.containers[0].name: Required value",
            id="container-without-a-name",
        ),
        pytest.param(
            {
                "template": {
                    "spec": {"containers": [{"name": "t", "ports": [{"containerPort": "x"}]}]}
                }
            },
            "spec.template.spec.containers[0].ports[0].containerPort",
            id="port-not-a-number",
        ),
        pytest.param(
            {
                "template": {
                    "spec": {
                        "containers": [{"name": "t", "resources": {"limits": {"cpu": "lots"}}}]
                    }
                }
            },
            "spec.template.spec.containers[0].resources.limits.cpu",
            id="cpu-not-a-quantity",
        ),
        pytest.param(
            {"template": {"spec": {"restartPolicy": "Sometimes", "containers": [{"name": "t"}]}}},
            "spec.template.spec.restartPolicy: Unsupported value",
            id="restart-policy-not-an-enum-value",
        ),
        pytest.param(
            {"checkpoint": {"uri": "s3://b/j", "nodeCache": {"sizeLimit": "10Mi"}}},
            "spec.checkpoint.nodeCache.sizeLimit must be a quantity of at least 64Mi",
            id="node-cache-too-small",
        ),
        pytest.param(
            {"checkpoint": {"uri": "s3://b/j", "stagingSizeLimit": "big"}},
            "spec.checkpoint.stagingSizeLimit is not a quantity",
            id="staging-not-a-quantity",
        ),
        pytest.param(
            {"checkpoint": {"uri": "s3://b/j", "sidecarResources": {"requests": {"cpu": "x"}}}},
            "spec.checkpoint.sidecarResources.requests.cpu",
            id="sidecar-resources-not-a-quantity",
        ),
        pytest.param({"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds", id="deadline-0"),
        pytest.param({"ttlSecondsAfterFinished": -1}, "spec.ttlSecondsAfterFinished", id="ttl-neg"),
    ],
)
def test_a_spec_that_cannot_work_is_refused_at_apply_naming_the_field(
    api_cluster: Cluster, ns: str, change: dict[str, Any], says: str
) -> None:
    body = refusal(lambda: create_job(api_cluster, ns, manifest("bad", **change)))
    assert says in body, body


def test_the_backend_cannot_change_mid_run_and_the_next_attempts_fields_can(
    api_cluster: Cluster, ns: str
) -> None:
    create_job(api_cluster, ns, manifest("edits"))
    body = refusal(lambda: patch(api_cluster, ns, "edits", {"spec": {"backend": "pytorchjob"}}))
    assert "spec.backend cannot change while the job exists" in body
    body = refusal(
        lambda: patch(api_cluster, ns, "edits", {"spec": {"checkpoint": {"uri": "s3://x/y"}}})
    )
    assert "spec.checkpoint.uri cannot change" in body
    # applied from the next attempt (docs/operator.md): accepted
    trainer = manifest("edits")["spec"]["template"]["spec"]["containers"][0]
    edited = patch(
        api_cluster,
        ns,
        "edits",
        {
            "spec": {
                "nprocPerNode": 2,
                "checkpoint": {"intervalSteps": 50, "credentialsSecret": "rotated"},
                "template": {"spec": {"containers": [{**trainer, "image": "trainer:2"}]}},
            }
        },
    )
    assert edited["spec"]["nprocPerNode"] == 2 and edited["metadata"]["generation"] == 2
    assert edited["spec"]["template"]["spec"]["containers"][0]["image"] == "trainer:2"


# ---- the status the operator writes, written by its own code ----


def operator_writes(cluster: Cluster, ns: str, name: str, **seen: Any) -> dict[str, Any]:
    """One reconcile's status writes: the job read, the decisions made from it (``seen``:
    the Observation's pods, fits, now) and their conditions written, as reconcile.py does;
    the status writes rendered and applied through
    the operator's API client. Returns the job after them."""
    job = get_job(cluster, ns, name)
    spec = JobSpec.parse(job["spec"])
    obs = Observation(
        spec=spec,
        state=job_state(job.get("status") or {}),
        pods=seen.pop("pods", []),
        nodes=[],
        fits=seen.pop("fits", []),
        uri="s3://bucket/jobs/x",
        now=seen.pop("now", time.time()),
        generation=job["metadata"]["generation"],
        selector=job_selector(name),
    )
    plan = written(decide(obs), obs.state.conditions, now=obs.now, generation=obs.generation)
    writes = Plan(tuple(a for a in plan.actions if isinstance(a, PatchStatus)))
    outcome = apply(
        render_plan(writes, Target(body=job, spec=spec)),
        Api.connect(cluster.api_client()),
        resource_version=job["metadata"]["resourceVersion"],
    )
    assert not outcome.stale
    return get_job(cluster, ns, name)


def wait(cluster: Cluster, ns: str, name: str, condition: str, timeout: str) -> bool:
    found = cluster.kubectl(
        "wait",
        f"--for=condition={condition}",
        f"--timeout={timeout}",
        "-n",
        ns,
        f"{PLURAL}.{GROUP}/{name}",
        check=False,
    )
    return found.returncode == 0


def test_kubectl_wait_follows_the_conditions_the_operator_writes(
    api_cluster: Cluster, ns: str
) -> None:
    name = "waited"
    create_job(api_cluster, ns, manifest(name, replicas=2, minReplicas=1, maxReplicas=2))
    queued = operator_writes(api_cluster, ns, name, fits=[])
    assert queued["status"]["phase"] == "Pending"
    assert wait(api_cluster, ns, name, "Queued", "10s")
    running = operator_writes(api_cluster, ns, name, fits=["n0", "n1"])["status"]
    assert (running["phase"], running["attempt"], running["worldSize"]) == ("Running", 1, 2)
    conditions = {c["type"]: c for c in running["conditions"]}
    assert conditions["Queued"]["status"] == "False" and conditions["Running"]["status"] == "True"
    assert not wait(api_cluster, ns, name, "Succeeded", "1s")
    # the scale subresource reads the selector and the world size
    scale = client.CustomObjectsApi(api_cluster.api_client()).get_namespaced_custom_object_scale(
        GROUP, VERSION, ns, PLURAL, name
    )
    assert scale["status"] == {"replicas": 2, "selector": f"{GROUP}/job-name={name}"}

    done = [PodView(f"{name}-a1-{r}", 1, r, "Succeeded", f"n{r}") for r in range(2)]
    finished = operator_writes(api_cluster, ns, name, pods=done, fits=["n0", "n1"])
    assert finished["status"]["phase"] == "Succeeded"
    assert wait(api_cluster, ns, name, "Succeeded", "10s")
    assert wait(api_cluster, ns, name, "Running=False", "10s")

    # an edit: until the operator has read it, no condition speaks for the new spec
    patch(api_cluster, ns, name, {"spec": {"checkpoint": {"intervalSteps": 7}}})
    assert not wait(api_cluster, ns, name, "Succeeded", "1s")
    seen = operator_writes(api_cluster, ns, name)
    assert seen["status"]["observedGeneration"] == seen["metadata"]["generation"] == 2
    assert wait(api_cluster, ns, name, "Succeeded", "10s")


def test_a_finished_job_is_deleted_only_while_it_is_the_one_read(
    api_cluster: Cluster, ns: str
) -> None:
    """The TTL's delete, through the operator's API client: a job changed since it was
    read (here, its TTL raised) is not deleted."""
    name = "expires"
    create_job(api_cluster, ns, manifest(name, ttlSecondsAfterFinished=0))
    read = get_job(api_cluster, ns, name)
    patch(api_cluster, ns, name, {"spec": {"ttlSecondsAfterFinished": 3600}})
    api = Api.connect(api_cluster.api_client())
    delete = render_plan(Plan((DeleteJob(0.0),)), Target(body=read, spec=None))
    rv = read["metadata"]["resourceVersion"]
    assert apply(delete, api, resource_version=rv).stale
    assert get_job(api_cluster, ns, name)["spec"]["ttlSecondsAfterFinished"] == 3600
    current = get_job(api_cluster, ns, name)
    rv = current["metadata"]["resourceVersion"]
    delete = render_plan(Plan((DeleteJob(0.0),)), Target(body=current, spec=None))
    assert apply(delete, api, resource_version=rv) == Outcome(rv)
    with pytest.raises(ApiException) as gone:
        get_job(api_cluster, ns, name)
    assert gone.value.status == 404


def test_kubectl_explain_describes_every_field_it_lists(
    api_cluster: Cluster, tmp_path: Path
) -> None:
    """What tests/unit/test_crd_schema.py checks in the file, as kubectl shows it: no
    "<no description>" for a field, no "<empty>" for the one explained."""

    def explain(path: str) -> subprocess.CompletedProcess[str]:
        return api_cluster.kubectl("--cache-dir", str(tmp_path), "explain", path, check=False)

    # the API server publishes a new CRD's OpenAPI a moment after it is established
    wait_for(lambda: explain("ctj.spec").returncode == 0, "ctj's OpenAPI served", 60)
    for path in (
        "ctj.spec",
        "ctj.spec.checkpoint",
        "ctj.spec.template.spec.containers.resources",
        "ctj.status",
        "ctj.status.conditions",
    ):
        shown = explain(path).stdout
        assert "FIELDS:" in shown, shown
        assert "<no description>" not in shown and "<empty>" not in shown, shown
    assert "limits\t<map[string]" in explain("ctj.spec.template.spec.containers.resources").stdout
