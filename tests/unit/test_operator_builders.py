"""The objects the operator creates, built without a cluster: what a trainer pod sees."""

from __future__ import annotations

from typing import Any

import pytest
from ctj_contract import LABEL_ATTEMPT, LABEL_JOB, LABEL_LAUNCHER, LABEL_RANK, LABEL_WORLD
from ctj_operator import builders
from ctj_operator.capacity import pod_requests
from ctj_operator.spec import JobSpec, NodeCache, SpecError

BODY = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}}
URI = "s3://bucket/jobs/ml/demo-u-1"


def job_spec(**overrides: Any) -> JobSpec:
    spec: dict[str, Any] = {
        "replicas": 3,
        "maxReplicas": 4,
        "nprocPerNode": 2,
        "checkpoint": {
            "uri": "s3://bucket/jobs",
            "endpoint": "http://minio:9000",
            "credentialsSecret": "s3-credentials",
            "intervalSteps": 25,
        },
        "template": {
            "metadata": {"labels": {"team": "ml"}},
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "image": "trainer:1",
                        "command": ["python", "train.py"],
                        "env": [
                            {"name": "CTJ_TOTAL_STEPS", "value": "100"},
                            {"name": "WORLD_SIZE", "value": "999"},  # ours must win
                        ],
                    }
                ]
            },
        },
    }
    spec.update(overrides)
    return JobSpec.parse(spec)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def pod(node_rank: int = 1, attempt: int = 2, world_size: int = 3) -> dict[str, Any]:
    return builders.build_pod(
        BODY, job_spec(), uri=URI, attempt=attempt, world_size=world_size, node_rank=node_rank
    )


def test_pod_gets_the_environment_a_pytorchjob_gives() -> None:
    env = env_of(pod()["spec"]["containers"][0])
    master = "demo-a2-0.demo"
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == master
    assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == str(builders.master_port(2))
    assert env["WORLD_SIZE"] == "6"  # 3 nodes x nprocPerNode 2
    assert env["RANK"] == "2"  # first global rank of node rank 1
    assert env["PET_NNODES"] == "3" and env["PET_NPROC_PER_NODE"] == "2"
    assert env["PET_NODE_RANK"] == env["NODE_RANK"] == "1"
    assert env["CTJ_TOTAL_STEPS"] == "100", "the template's own variables stay"
    assert [e["name"] for e in pod()["spec"]["containers"][0]["env"]].count("WORLD_SIZE") == 1


def test_each_attempt_rendezvous_on_its_own_port() -> None:
    ports = {env_of(pod(attempt=a)["spec"]["containers"][0])["MASTER_PORT"] for a in (1, 2, 3)}
    assert len(ports) == 3


def test_pod_and_sidecar_get_the_checkpoint_location_and_credentials_only_as_secret_refs() -> None:
    spec = pod()["spec"]
    sidecar = spec["initContainers"][-1]
    for container in (spec["containers"][0], sidecar):
        env = env_of(container)
        assert env["CTJ_CHECKPOINT_URI"] == URI
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key] == {"secretKeyRef": {"name": "s3-credentials", "key": key}}
        assert all("value" not in e for e in container["env"] if e["name"].startswith("AWS_S"))
    assert env_of(spec["containers"][0])["CTJ_SAVE_EVERY"] == "25"


def test_sidecar_startup_probe_waits_for_readyz_in_one_exec_before_any_readiness_probe() -> None:
    """A healthy start fails no probe (no Unhealthy Warning): the startup probe waits, in the
    container, until /readyz answers, and readiness probes only start after it."""
    sidecar = pod()["spec"]["initContainers"][-1]
    startup = sidecar["startupProbe"]
    command = startup["exec"]["command"]
    assert command[:4] == ["python", "-m", "trainer_sidecar.metrics", "wait-ready"]
    assert command[command.index("--port") + 1] == str(builders.METRICS_PORT)
    wait_s = float(command[command.index("--timeout") + 1])
    assert wait_s < startup["timeoutSeconds"], "the probe's own wait must end first"
    attempts = startup["failureThreshold"] * (startup["timeoutSeconds"] + startup["periodSeconds"])
    assert attempts >= 300, "a slow store gets minutes before the sidecar is restarted"
    assert sidecar["readinessProbe"]["httpGet"] == {
        "path": "/readyz",
        "port": builders.METRICS_PORT,
    }
    assert "livenessProbe" not in sidecar


def test_sidecar_is_native_and_shares_a_memory_backed_staging_volume() -> None:
    spec = pod()["spec"]
    sidecar = spec["initContainers"][-1]
    assert sidecar["name"] == "ctj-sidecar"
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert sidecar["command"][:4] == ["python", "-m", "trainer_sidecar", "sidecar"]
    staging = {"name": "ctj-staging", "mountPath": builders.STAGING_PATH}
    assert staging in sidecar["volumeMounts"]
    assert staging in spec["containers"][0]["volumeMounts"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "ctj-staging"]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert spec["restartPolicy"] == "Never"


def test_pod_identity_labels_dns_and_one_rank_per_node() -> None:
    p = pod(node_rank=1, attempt=2, world_size=3)
    meta, spec = p["metadata"], p["spec"]
    assert meta["name"] == "demo-a2-1"
    assert meta["labels"] == {
        "team": "ml",
        LABEL_JOB: "demo",
        LABEL_ATTEMPT: "2",
        LABEL_RANK: "1",
        LABEL_WORLD: "3",
        LABEL_LAUNCHER: "true",
    }
    assert (spec["hostname"], spec["subdomain"]) == ("demo-a2-1", "demo")
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == {
        LABEL_JOB: "demo",
    }
    (owner,) = meta["ownerReferences"]
    assert owner["uid"] == "u-1" and owner["controller"] is True


def test_service_is_headless_and_owned() -> None:
    svc = builders.build_service(BODY)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {LABEL_JOB: "demo"}
    assert svc["metadata"]["ownerReferences"][0]["kind"] == "CheckpointedTrainingJob"


def test_the_template_is_not_mutated() -> None:
    spec = job_spec()
    before = repr(spec.template)
    builders.build_pod(BODY, spec, uri=URI, attempt=1, world_size=3, node_rank=0)
    builders.build_pytorchjob(BODY, spec, uri=URI, attempt=1, world_size=3)
    assert repr(spec.template) == before


@pytest.mark.parametrize("world_size", [1, 3])
def test_pytorchjob_has_one_master_and_n_minus_one_workers(world_size: int) -> None:
    job = builders.build_pytorchjob(BODY, job_spec(), uri=URI, attempt=2, world_size=world_size)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["metadata"]["name"] == "demo-a2"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert replicas.get("Worker", {}).get("replicas", 0) == world_size - 1
    pod_spec = replicas["Master"]["template"]["spec"]
    assert pod_spec["containers"][0]["name"] == "pytorch"
    assert pod_spec["initContainers"][-1]["name"] == "ctj-sidecar"
    assert job["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_pytorchjob_rendezvous_port_placement_and_restart_rules() -> None:
    """What the Kubeflow controller reads (the port named pytorchjob-port becomes
    MASTER_PORT) and what it must not do (restart a rank, or delete the pods of a failed
    attempt before the operator has read them: no backoffLimit, cleanPodPolicy None)."""
    spec = job_spec()
    job = builders.build_pytorchjob(BODY, spec, uri=URI, attempt=2, world_size=3, avoid=("n2",))
    assert job["spec"]["runPolicy"] == {"cleanPodPolicy": "None"}
    for kind in ("Master", "Worker"):
        replica = job["spec"]["pytorchReplicaSpecs"][kind]
        assert replica["restartPolicy"] == "Never"
        pod_spec = replica["template"]["spec"]
        (port,) = pod_spec["containers"][0]["ports"]
        assert port == {"name": "pytorchjob-port", "containerPort": builders.master_port(2)}
        affinity = pod_spec["affinity"]
        anti = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["labelSelector"]["matchLabels"] == {LABEL_JOB: "demo"}
        terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n2"]
        labels = replica["template"]["metadata"]["labels"]
        assert labels["team"] == "ml" and labels[LABEL_ATTEMPT] == "2"


def test_a_failed_pytorchjob_or_trainjob_says_why() -> None:
    assert builders.controller_failure({"status": {"conditions": []}}) == ""
    running = [{"type": "Running", "status": "True"}]
    assert builders.controller_failure({"status": {"conditions": running}}) == ""
    failed = {
        "kind": "PyTorchJob",
        "metadata": {"name": "demo-a1"},
        "status": {
            "conditions": [
                {"type": "Running", "status": "False"},
                {"type": "Failed", "status": "True", "message": "1 Worker replica(s) failed."},
            ]
        },
    }
    why = builders.controller_failure(failed)
    assert why == "PyTorchJob demo-a1 failed: 1 Worker replica(s) failed."
    failed["kind"] = "TrainJob"
    assert builders.controller_failure(failed).startswith("TrainJob demo-a1 failed: 1 Worker")


def test_the_sidecar_answers_heartbeats_with_the_job_token_its_attempt_and_rank() -> None:
    """No Lease, no Role, no API access: the sidecar has the job's token from its Secret."""
    env = env_of(pod()["spec"]["initContainers"][-1])
    token = {"secretKeyRef": {"name": "demo-ctj-cache", "key": "token"}}
    assert env["CTJ_CACHE_TOKEN"] == token
    assert env["NODE_RANK"] == "1" and env["CTJ_ATTEMPT"] == "2"
    assert "CTJ_HEARTBEAT_LEASE" not in env


def test_a_pytorchjob_master_knows_it_is_rank_0_and_a_worker_no_rank() -> None:
    spec = job_spec(backend="pytorchjob")
    job = builders.build_pytorchjob(BODY, spec, uri=URI, attempt=2, world_size=3)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    master = env_of(replicas["Master"]["template"]["spec"]["initContainers"][-1])
    worker = env_of(replicas["Worker"]["template"]["spec"]["initContainers"][-1])
    assert master["CTJ_CACHE_TOKEN"] == worker["CTJ_CACHE_TOKEN"]
    assert master["CTJ_ATTEMPT"] == worker["CTJ_ATTEMPT"] == "2"
    assert master["NODE_RANK"] == "0" and "NODE_RANK" not in worker


def test_suspect_nodes_are_excluded_from_every_node_selector_term() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]},
                ]
            }
        }
    }
    template = job_spec().template
    spec = job_spec(template={**template, "spec": {**template["spec"], "affinity": affinity}})
    built = builders.build_pod(
        BODY, spec, uri=URI, attempt=2, world_size=3, node_rank=0, avoid=("n2",)
    )
    terms = built["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert len(terms) == 2
    for term in terms:
        assert term["matchFields"] == [
            {"key": "metadata.name", "operator": "NotIn", "values": ["n2"]}
        ]
    plain = builders.build_pod(
        BODY, job_spec(), uri=URI, attempt=2, world_size=3, node_rank=0, avoid=("n2",)
    )
    (term,) = plain["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term == {
        "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n2"]}]
    }
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0] == {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}


CACHE = NodeCache()


def cached_spec(backend: str = "pods", **checkpoint: Any) -> JobSpec:
    spec = job_spec()
    raw = {
        "replicas": 3,
        "backend": backend,
        "checkpoint": {"uri": "s3://bucket/jobs", **checkpoint},
        "template": spec.template,
    }
    return JobSpec.parse(raw, node_cache=CACHE)


def test_the_node_cache_is_the_node_agent_named_in_both_containers_with_no_hostpath() -> None:
    p = builders.build_pod(BODY, cached_spec(), uri=URI, attempt=2, world_size=3, node_rank=1)
    spec = p["spec"]
    assert not [v for v in spec.get("volumes", []) if "hostPath" in v]
    trainer, sidecar = spec["containers"][0], spec["initContainers"][-1]
    peers = ",".join(f"demo-a2-{r}.demo:{builders.CACHE_PORT}" for r in range(3))
    for container in (trainer, sidecar):
        env = env_of(container)
        # the agent's hostPort on the pod's own node, and the job it speaks for
        assert env["CTJ_NODE_AGENT_HOST"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
        assert env["CTJ_NODE_AGENT_PORT"] == "9403"
        assert (env["CTJ_JOB_NAMESPACE"], env["CTJ_JOB_NAME"], env["CTJ_JOB_UID"]) == (
            "ml", "demo", "u-1",
        )  # fmt: skip
        assert "CTJ_CACHE_DIR" not in env
        assert env["CTJ_CACHE_PEERS"] == peers
        # the token only as a reference to the job's Secret
        assert env["CTJ_CACHE_TOKEN"] == {
            "secretKeyRef": {"name": "demo-ctj-cache", "key": "token"}
        }
        assert not [m for m in container.get("volumeMounts", []) if m["name"] == "ctj-cache"]
    assert env_of(sidecar)["CTJ_CACHE_PORT"] == str(builders.CACHE_PORT)
    assert "CTJ_CACHE_PORT" not in env_of(trainer)
    # no root step: nothing of ours runs as root
    assert all(
        (c.get("securityContext") or {}).get("runAsUser") != 0 for c in spec["initContainers"]
    )


def test_pytorchjob_peers_are_the_controllers_pod_services() -> None:
    job = builders.build_pytorchjob(
        BODY, cached_spec("pytorchjob"), uri=URI, attempt=1, world_size=3
    )
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert env_of(master["containers"][0])["CTJ_CACHE_PEERS"] == (
        "demo-a1-master-0:9402,demo-a1-worker-0:9402,demo-a1-worker-1:9402"
    )


def test_a_job_may_turn_off_the_node_cache_and_the_operator_default_is_off() -> None:
    assert cached_spec().checkpoint.node_cache == CACHE
    # the agent bounds the cache per node: a job's sizeLimit is checked, not applied
    assert cached_spec(nodeCache={"sizeLimit": "1Gi"}).checkpoint.node_cache == CACHE
    assert cached_spec(nodeCache={"enabled": False}).checkpoint.node_cache is None
    assert job_spec().checkpoint.node_cache is None  # the operator was given no agent port
    plain = builders.build_pod(BODY, job_spec(), uri=URI, attempt=1, world_size=2, node_rank=0)
    assert "CTJ_NODE_AGENT_HOST" not in env_of(plain["spec"]["containers"][0])
    with pytest.raises(SpecError, match=r"nodeCache\.sizeLimit='lots' is not a quantity"):
        cached_spec(nodeCache={"sizeLimit": "lots"})


def test_the_cache_secret_is_owned_by_the_job() -> None:
    secret = builders.build_cache_secret(BODY, "t" * 64)
    assert secret["metadata"]["name"] == "demo-ctj-cache"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert secret["stringData"] == {"token": "t" * 64}


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize(
    "template_spec",
    [
        {"containers": [{"name": "t", "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}}]},
        {
            "containers": [
                {"name": "t", "resources": {"limits": {"nvidia.com/gpu": "8", "cpu": "8"}}},
                {"name": "u", "resources": {"requests": {"cpu": "500m"}}},
            ],
            "initContainers": [
                {"name": "fetch", "resources": {"requests": {"memory": "64Gi"}}},
                {"name": "proxy", "restartPolicy": "Always", "resources": {"requests": {"cpu": 1}}},
            ],
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "overhead": {"cpu": "100m"},
        },
        {"containers": [{"name": "t"}], "resources": {"requests": {"cpu": "3", "memory": "1Gi"}}},
    ],
)
def test_a_rank_s_footprint_is_what_its_pod_will_request_and_where_it_may_run(
    template_spec: dict[str, Any], cached: bool
) -> None:
    """Capacity is computed from the spec (rank_footprint), never from a built pod: the
    two must agree on every request (the sidecar's and the cache step's included) and on
    every field the scheduler filters by."""
    sidecar = {"requests": {"cpu": "250m", "memory": "512Mi"}}
    raw = {
        "replicas": 2,
        "checkpoint": {"uri": "s3://b/p", "sidecarResources": sidecar},
        "template": {"spec": template_spec},
    }
    spec = JobSpec.parse(raw, node_cache=CACHE if cached else None)
    pod = builders.build_pod(BODY, spec, uri=URI, attempt=1, world_size=2, node_rank=0)
    footprint = builders.rank_footprint(spec)
    assert pod_requests(footprint) == pod_requests(pod["spec"])
    assert pod_requests(footprint)["cpu"] >= 250, "the sidecar's requests count"
    for field in ("nodeSelector", "tolerations", "overhead", "resources"):
        assert footprint.get(field) == template_spec.get(field)


def test_a_trainer_that_fails_leaves_its_last_log_lines_as_its_termination_message() -> None:
    trainer = pod()["spec"]["containers"][0]
    assert trainer["terminationMessagePolicy"] == "FallbackToLogsOnError"
    template = job_spec().template
    template["spec"]["containers"][0]["terminationMessagePolicy"] = "File"  # the user's
    spec = job_spec(template=template)
    mine = builders.build_pod(BODY, spec, uri=URI, attempt=1, world_size=3, node_rank=0)
    assert mine["spec"]["containers"][0]["terminationMessagePolicy"] == "File"


def pod_specs(spec: JobSpec) -> list[dict[str, Any]]:
    """Every pod spec the operator would create or hand a controller for one attempt of
    ``spec`` at world size 3, under its backend."""
    if spec.backend.value == "pytorchjob":
        job = builders.build_pytorchjob(BODY, spec, uri=URI, attempt=1, world_size=3)
        return [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    if spec.backend.value == "trainjob":
        runtime = builders.build_trainjob(BODY, spec, uri=URI, attempt=1, world_size=3)[0]
        jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
        return [j["template"]["spec"]["template"]["spec"] for j in jobs]
    return [
        builders.build_pod(BODY, spec, uri=URI, attempt=1, world_size=3, node_rank=rank)["spec"]
        for rank in range(3)
    ]


@pytest.mark.parametrize("backend", ["pods", "pytorchjob", "trainjob"])
def test_with_the_agents_csi_driver_the_trainer_mounts_its_jobs_node_cache_read_only(
    backend: str,
) -> None:
    driver = NodeCache(driver="node-cache.ctj.dev")
    raw = {"replicas": 3, "backend": backend, "checkpoint": {"uri": "s3://bucket/jobs"},
           "template": job_spec().template}  # fmt: skip
    for spec in pod_specs(JobSpec.parse(raw, node_cache=driver)):
        volumes = [v for v in spec["volumes"] if v["name"] == builders.NODE_CACHE_VOLUME]
        assert volumes == [{
            "name": builders.NODE_CACHE_VOLUME,
            "csi": {"driver": "node-cache.ctj.dev", "readOnly": True,
                    "volumeAttributes": {"job": "demo", "uid": "u-1"}},
        }]  # fmt: skip
        trainer, sidecar = spec["containers"][0], spec["initContainers"][-1]
        assert {"name": builders.NODE_CACHE_VOLUME, "mountPath": "/var/run/ctj/node-cache",
                "readOnly": True} in trainer["volumeMounts"]  # fmt: skip
        assert env_of(trainer)["CTJ_NODE_CACHE_MOUNT"] == "/var/run/ctj/node-cache"
        # the sidecar writes through the agent and reads peers' agents: no mount
        assert "CTJ_NODE_CACHE_MOUNT" not in env_of(sidecar)
        assert builders.NODE_CACHE_VOLUME not in {m["name"] for m in sidecar["volumeMounts"]}
    # without the driver (the operator's default): no volume, every read over HTTP
    for spec in pod_specs(JobSpec.parse(raw, node_cache=CACHE)):
        assert builders.NODE_CACHE_VOLUME not in {v["name"] for v in spec.get("volumes", [])}
        assert "CTJ_NODE_CACHE_MOUNT" not in env_of(spec["containers"][0])


@pytest.mark.parametrize("driver", ["", "Node_Cache", "a" * 64, "-x.dev"])
def test_a_bad_csi_driver_name_is_refused_naming_the_fix(driver: str) -> None:
    with pytest.raises(SpecError, match="node-cache.ctj.dev"):
        NodeCache(driver=driver)
