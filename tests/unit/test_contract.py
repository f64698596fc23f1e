"""The contract between the operator and the pods: what the operator's builders write, the
engine reads back, by the same names (ctj_contract). A pod is built as the operator
builds it; its containers' environment is resolved as a kubelet would (fieldRefs from
the pod, secretKeyRefs from Secrets); the engine's configuration starts from it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ctj_contract import (
    ANNOTATION_LAST_CHECKPOINT,
    Env,
    LastCheckpoint,
    checkpoint_request_patch,
    heartbeat_patch,
)
from ctj_operator import builders
from ctj_operator.observe import last_checkpoint, lease_summary
from ctj_operator.spec import JobSpec, NodeCache

from trainer_sidecar.config import CheckpointConfig
from trainer_sidecar.format.manifest import Mode
from trainer_sidecar.heartbeat import HeartbeatSettings, last_checkpoint_value

BODY = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}}
POD_IP = "10.1.2.3"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3cr3t-s3cr3t"}
CACHE_TOKEN = "0123456789abcdef0123456789abcdef"


def job_spec(*, node_cache: bool = True, backend: str = "pods") -> JobSpec:
    return JobSpec.parse(
        {
            "replicas": 3,
            "backend": backend,
            "checkpoint": {
                "uri": "s3://bucket/jobs",
                "endpoint": "http://seaweedfs:8333",
                "credentialsSecret": "s3-credentials",
                "intervalSteps": 25,
                "mode": "differential",
                "fullEvery": 4,
                "keepLast": 5,
            },
            "failureDetection": {"heartbeatPeriodSeconds": 1.5, "heartbeatTimeoutSeconds": 6},
            "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1"}]}},
        },
        node_cache=NodeCache("/var/lib/ctj", 1 << 30) if node_cache else None,
    )


def resolved_env(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """What the process in ``container`` finds in its environment."""
    meta = pod["metadata"]
    secrets = {
        "s3-credentials": CREDENTIALS,
        builders.cache_secret_name("demo"): {"token": CACHE_TOKEN},
    }
    fields = {"metadata.name": meta["name"], "metadata.namespace": "ml", "status.podIP": POD_IP}
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def containers(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the trainer, the sidecar) of a rank's pod."""
    spec = pod["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == builders.SIDECAR_NAME)
    return spec["containers"][0], sidecar


@pytest.mark.parametrize("node_rank", [0, 2])
def test_the_engine_starts_from_the_environment_the_operator_gives_a_rank(
    node_rank: int,
) -> None:
    spec = job_spec()
    uri = "s3://bucket/jobs/ml/demo-u-1"
    pod = builders.build_pod(BODY, spec, uri=uri, attempt=7, world_size=3, node_rank=node_rank)
    trainer, sidecar = containers(pod)
    peers = tuple(f"demo-a7-{r}.demo:{builders.CACHE_PORT}" for r in range(3))
    for container, in_sidecar in ((trainer, False), (sidecar, True)):
        env = resolved_env(pod, container)
        config = CheckpointConfig.from_env(env)
        assert config.uri == uri
        assert config.mode is Mode.DIFFERENTIAL
        assert (config.full_every, config.keep_last) == (4, 5)
        assert config.endpoint_url == "http://seaweedfs:8333"
        assert config.staging_dir == builders.STAGING_PATH
        assert config.sidecar is True, "the trainer must leave persisting to the sidecar"
        if not in_sidecar:  # the trainer names each save; the sidecar reads it from the slot
            assert config.attempt == "7", "every save's identity carries the attempt"
        assert config.cache_dir == builders.CACHE_PATH
        assert config.cache_max_bytes == 1 << 30
        assert config.cache_peers == peers
        assert config.cache_token == CACHE_TOKEN
        assert config.cache_port == (builders.CACHE_PORT if in_sidecar else None)
        assert {env[Env.S3_ACCESS_KEY], env[Env.S3_SECRET_KEY]} == set(CREDENTIALS.values())
    env = resolved_env(pod, sidecar)
    beat = HeartbeatSettings.from_env(env)
    assert beat is not None
    assert beat == HeartbeatSettings(
        lease=f"demo-a7-{node_rank}", namespace="ml", period_s=1.5, rank0=node_rank == 0
    )
    assert env[Env.METRICS_HOST] == POD_IP
    assert resolved_env(pod, trainer)[Env.SAVE_EVERY] == "25"


def test_the_heartbeat_lease_the_operator_makes_is_the_one_the_sidecar_renews() -> None:
    spec = job_spec()
    leases = builders.build_leases(BODY, spec, attempt=3, world_size=2)
    for rank, lease in enumerate(leases):
        pod = builders.build_pod(
            BODY, spec, uri="s3://b/p", attempt=3, world_size=2, node_rank=rank
        )
        beat = HeartbeatSettings.from_env(resolved_env(pod, containers(pod)[1]))
        assert beat is not None
        assert beat.lease == lease["metadata"]["name"] == pod["metadata"]["name"]
        assert lease_summary(lease)["rank"] == rank


def test_a_pytorchjob_rank_finds_its_lease_and_whether_it_is_rank_0() -> None:
    spec = job_spec(backend="pytorchjob")
    job = builders.build_pytorchjob(BODY, spec, uri="s3://b/p", attempt=2, world_size=3)
    for kind, name, rank0 in (
        ("Master", "demo-a2-master-0", True),
        ("Worker", "demo-a2-worker-1", False),
    ):
        template = job["spec"]["pytorchReplicaSpecs"][kind]["template"]
        pod = {"metadata": {"name": name, **template["metadata"]}, "spec": template["spec"]}
        trainer, sidecar = containers(pod)
        beat = HeartbeatSettings.from_env(resolved_env(pod, sidecar))
        assert beat is not None and (beat.lease, beat.rank0) == (name, rank0)
        config = CheckpointConfig.from_env(resolved_env(pod, trainer))
        assert config.attempt == "2" and config.sidecar


def test_what_rank_0_reports_is_what_the_operator_reads() -> None:
    @dataclasses.dataclass
    class Commit:
        step: int = 120
        created: float = 1796126400.0
        logical_bytes: int = 1 << 20

    value = last_checkpoint_value(Commit())
    patch = heartbeat_patch(1796126401.0, value)
    labels = builders.heartbeat_labels("demo", 1, 0)
    lease = {"metadata": {"name": "demo-a1-0", "labels": labels, **patch["metadata"]}}
    assert lease["metadata"]["annotations"] == {ANNOTATION_LAST_CHECKPOINT: value}
    assert last_checkpoint([lease_summary(lease)]) == {
        "step": 120,
        "time": "2026-12-01T12:00:00Z",
        "bytes": 1 << 20,
    }


@pytest.mark.parametrize(
    "value",
    [None, "", "not json", "[]", '{"time": "t"}', '{"step": "x"}', '{"step": 1, "bytes": "y"}'],
)
def test_a_malformed_report_is_no_checkpoint(value: str | None) -> None:
    assert LastCheckpoint.decode(value) is None


def test_every_environment_name_the_operator_writes_is_the_contract_s() -> None:
    """No CTJ_ name is spelled on one side only: each one a pod gets is in Env, and every
    Env name reaches some container of some pod."""
    contract = {v for k, v in vars(Env).items() if k.isupper()}
    written: set[str] = set()
    seeded = job_spec()  # spec.checkpoint.resumeFrom: a job's name
    seeded = dataclasses.replace(
        seeded, checkpoint=dataclasses.replace(seeded.checkpoint, resume_from="train")
    )
    for spec in (job_spec(), job_spec(node_cache=False), seeded):
        pod = builders.build_pod(BODY, spec, uri="s3://b/p", attempt=1, world_size=2, node_rank=0)
        for container in (*pod["spec"]["initContainers"], *pod["spec"]["containers"]):
            written |= {e["name"] for e in container.get("env") or []}
    ours = {name for name in written if name.startswith(("CTJ_", "AWS_"))} | {"NODE_RANK"}
    assert ours <= contract
    assert contract <= written
    assert checkpoint_request_patch("r-1") == {
        "metadata": {"annotations": {"training.ctj.dev/checkpoint-request": "r-1"}}
    }
