"""The contract between the operator and the pods: what the operator's builders write, the
engine reads back, by the same names (ctj_contract). A pod is built as the operator
builds it; its containers' environment is resolved as a kubelet would (fieldRefs from
the pod, secretKeyRefs from Secrets); the engine's configuration starts from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from ctj_contract import (
    NODE_CACHE_DRIVER,
    NODE_CACHE_MOUNT_PATH,
    Env,
    HeartbeatAsk,
    HeartbeatReply,
    LastCheckpoint,
)
from ctj_operator import builders
from ctj_operator.heartbeats import HeartbeatChannel, JobAsk, Rank
from ctj_operator.observe import Freshness, pod_summary
from ctj_operator.spec import JobSpec, NodeCache

from trainer_sidecar.config import CheckpointConfig
from trainer_sidecar.format.manifest import Mode
from trainer_sidecar.heartbeat import HeartbeatEndpoint, HeartbeatSettings, last_checkpoint_value
from trainer_sidecar.parts import Parts
from trainer_sidecar.store.agent_client import AgentCache
from trainer_sidecar.store.memory import MemoryStore

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
        node_cache=NodeCache() if node_cache else None,
    )


def resolved_env(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """What the process in ``container`` finds in its environment."""
    meta = pod["metadata"]
    secrets = {
        "s3-credentials": CREDENTIALS,
        builders.cache_secret_name("demo"): {"token": CACHE_TOKEN},
    }
    fields = {
        "metadata.name": meta["name"],
        "metadata.namespace": "ml",
        "status.podIP": POD_IP,
        "status.hostIP": "10.0.0.9",
    }
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
        assert config.cache_dir is None  # no hostPath: the node agent holds the cache
        assert config.node_agent == "10.0.0.9:9403"  # the node's address, the agent's port
        assert (config.job_namespace, config.job_name) == ("ml", "demo")
        assert config.job_uid == BODY["metadata"]["uid"]
        assert config.cache_peers == peers
        assert config.cache_token == CACHE_TOKEN
        assert config.cache_port == (builders.CACHE_PORT if in_sidecar else None)
        assert {env[Env.S3_ACCESS_KEY], env[Env.S3_SECRET_KEY]} == set(CREDENTIALS.values())
    env = resolved_env(pod, sidecar)
    beat = HeartbeatSettings.from_env(env)
    assert beat == HeartbeatSettings(token=CACHE_TOKEN, attempt=7, node_rank=node_rank)
    assert env[Env.METRICS_HOST] == POD_IP
    assert resolved_env(pod, trainer)[Env.SAVE_EVERY] == "25"


def test_the_rank_the_operator_asks_is_the_one_whose_sidecar_answers(tmp_path: Path) -> None:
    """The pod as the watch summarizes it, the ask the channel sends, the sidecar's
    settings from the pod's environment and its reply: the same attempt and rank, the
    same token, rank 0's report read back as the operator shows it."""

    @dataclasses.dataclass
    class Commit:
        step: int = 120
        created: float = 1796126400.0
        logical_bytes: int = 1 << 20

    spec = job_spec()
    pod = builders.build_pod(BODY, spec, uri="s3://b/p", attempt=3, world_size=2, node_rank=0)
    pod["status"] = {"phase": "Running", "podIP": POD_IP}
    channel = HeartbeatChannel(b"k" * 32, Freshness())
    channel.track("ml", "demo", pod_summary(pod))
    rank = channel.ranks[("ml", "demo-a3-0")]
    assert rank == Rank(("ml", "demo"), "demo-a3-0", POD_IP, 3, 0)
    job = JobAsk(uid="u-1", attempt=3, ended=False, request="3-ScaleUp-1", period_s=1.5)
    settings = HeartbeatSettings.from_env(resolved_env(pod, containers(pod)[1]))
    assert settings is not None
    endpoint = HeartbeatEndpoint(settings, latest=Commit, root=tmp_path)
    code, _, body = endpoint.handle(job.ask_for(rank).encode(), f"Bearer {CACHE_TOKEN}")
    assert code == 200
    reply = HeartbeatReply.decode(body)
    assert (reply.attempt, reply.node_rank, reply.request_seen) == (3, 0, "3-ScaleUp-1")
    assert LastCheckpoint.decode(reply.last_checkpoint) == LastCheckpoint(
        120, "2026-12-01T12:00:00Z", 1 << 20
    )
    assert last_checkpoint_value(Commit()) == reply.last_checkpoint


def test_the_token_the_operator_derives_is_the_one_in_the_job_secret() -> None:
    """The operator authenticates its asks with the token it wrote into the job's Secret."""
    channel = HeartbeatChannel(b"k" * 32, Freshness())
    token = channel.token(("ml", "demo"), "u-1")
    secret = builders.build_cache_secret(BODY, token)
    assert secret["stringData"]["token"] == token
    assert token != channel.token(("ml", "demo"), "u-2"), "a new job of the name: a new token"


def test_a_pytorchjob_rank_knows_its_attempt_and_whether_it_is_rank_0() -> None:
    spec = job_spec(backend="pytorchjob")
    job = builders.build_pytorchjob(BODY, spec, uri="s3://b/p", attempt=2, world_size=3)
    for kind, name, rank in (
        ("Master", "demo-a2-master-0", 0),
        ("Worker", "demo-a2-worker-1", None),
    ):
        template = job["spec"]["pytorchReplicaSpecs"][kind]["template"]
        pod = {"metadata": {"name": name, **template["metadata"]}, "spec": template["spec"]}
        trainer, sidecar = containers(pod)
        beat = HeartbeatSettings.from_env(resolved_env(pod, sidecar))
        assert beat is not None and (beat.attempt, beat.node_rank) == (2, rank)
        config = CheckpointConfig.from_env(resolved_env(pod, trainer))
        assert config.attempt == "2" and config.sidecar


def test_the_ask_round_trips() -> None:
    ask = HeartbeatAsk(attempt=4, ended=True, checkpoint_request="r-1")
    assert HeartbeatAsk.decode(ask.encode()) == ask
    reply = HeartbeatReply(attempt=4, node_rank=None, request_seen=None, last_checkpoint=None)
    assert HeartbeatReply.decode(reply.encode()) == reply
    silent = HeartbeatReply(attempt=4, node_rank=1, trainer_silent_s=2.5)
    assert HeartbeatReply.decode(silent.encode()) == silent


@pytest.mark.parametrize("value", ['"3"', "-1", "true", "NaN", "Infinity", "[1]"])
def test_a_reply_with_a_bad_trainer_silence_is_refused(value: str) -> None:
    """The reply comes off the network: a silence that is not a finite count of seconds is
    not a beat (it would otherwise decide, or forbid, a RankHung)."""
    raw = f'{{"attempt": 1, "nodeRank": 0, "trainerSilentSeconds": {value}}}'.encode()
    with pytest.raises(ValueError, match="trainerSilentSeconds"):
        HeartbeatReply.decode(raw)


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
    mounted = dataclasses.replace(seeded, checkpoint=dataclasses.replace(
        seeded.checkpoint, node_cache=NodeCache(driver=NODE_CACHE_DRIVER)))  # fmt: skip
    for spec in (job_spec(), job_spec(node_cache=False), seeded, mounted):
        pod = builders.build_pod(BODY, spec, uri="s3://b/p", attempt=1, world_size=2, node_rank=0)
        spare = builders.build_spare(BODY, spec, uri="s3://b/p", name="s", peers=["p0"])
        for container in (
            *pod["spec"]["initContainers"], *pod["spec"]["containers"],
            *spare["spec"]["initContainers"], *spare["spec"]["containers"],
        ):  # fmt: skip
            written |= {e["name"] for e in container.get("env") or []}
    ours = {name for name in written if name.startswith(("CTJ_", "AWS_"))} | {"NODE_RANK"}
    assert ours <= contract
    assert contract - {Env.PRELOAD} <= written  # CTJ_PRELOAD: the user's, in the template


def test_the_trainer_reads_its_node_cache_where_the_operator_mounts_it() -> None:
    spec = JobSpec.parse(
        {"replicas": 2, "checkpoint": {"uri": "s3://bucket/jobs"},
         "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1"}]}}},
        node_cache=NodeCache(driver=NODE_CACHE_DRIVER),
    )  # fmt: skip
    pod = builders.build_pod(BODY, spec, uri="s3://b/p", attempt=1, world_size=2, node_rank=0)
    trainer, sidecar = containers(pod)
    config = CheckpointConfig.from_env(resolved_env(pod, trainer))
    mounted = {m["mountPath"] for m in trainer["volumeMounts"] if m.get("readOnly")}
    assert config.node_cache_mount == NODE_CACHE_MOUNT_PATH and NODE_CACHE_MOUNT_PATH in mounted
    cache = Parts.open(config, store=MemoryStore()).cache
    assert isinstance(cache, AgentCache) and str(cache.mount) == NODE_CACHE_MOUNT_PATH
    assert CheckpointConfig.from_env(resolved_env(pod, sidecar)).node_cache_mount is None
