"""spec.checkpoint.resumeFrom, the operator's half: what the CRD admits, how spec.py parses
it, what a trainer pod is given, and that the engine's config reads it back from that pod.
The trainer's half (which location a name resolves to) is test_resume_from_source.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ctj_contract import Env
from ctj_operator import builders
from ctj_operator.spec import (
    NAME_PATTERN,
    URI_PATTERN,
    JobSpec,
    ResumeSource,
    SpecError,
    job_checkpoint_uri,
    resume_source,
)

from trainer_sidecar.config import CheckpointConfig

ROOT = Path(__file__).resolve().parents[2]
CRD_PATHS = [
    ROOT / "crds" / "training.ctj.dev_checkpointedtrainingjobs.yaml",
    ROOT / "charts" / "ctj" / "crds" / "training.ctj.dev_checkpointedtrainingjobs.yaml",
]
UID = "0b6f2d3a-5c1e-4f7a-9d2b-3e4f5a6b7c8d"


def checkpoint_schema(path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return dict(spec["properties"]["checkpoint"])


SCHEMA = checkpoint_schema(CRD_PATHS[0])
FIELD = SCHEMA["properties"]["resumeFrom"]
PATTERN = re.compile(FIELD["pattern"])

GOOD = [
    "train",
    "train-2",
    "llama.finetune-v3",
    f"s3://bucket/jobs/ml/train-{UID}",
    f"s3://bucket/jobs/ml/train-{UID}/",
    "file:///data/ckpt/ml/train",
]
BAD = [
    "Train",  # names are lowercase
    "-train",
    "train_2",
    "ml/train",  # another namespace: use the location
    "s3:/bucket/x",
    "s3://b/a//c",
    "s3://user:secret@b/x",
    "gs://bucket/x",
    "",
]


def job(resume_from: str | None = None, uri: str = "s3://bucket/jobs") -> JobSpec:
    checkpoint: dict[str, Any] = {"uri": uri}
    if resume_from is not None:
        checkpoint["resumeFrom"] = resume_from
    return JobSpec.parse(
        {"checkpoint": checkpoint, "template": {"spec": {"containers": [{"name": "t"}]}}}
    )


@pytest.mark.parametrize("value", GOOD)
def test_the_crd_and_the_operator_admit_a_name_or_a_location(value: str) -> None:
    assert PATTERN.fullmatch(value), f"the CRD would refuse {value!r}"
    assert job(value).checkpoint.resume_from == value


@pytest.mark.parametrize("value", BAD[:-1])
def test_the_crd_and_the_operator_refuse_the_same_values_naming_the_field(value: str) -> None:
    assert not PATTERN.fullmatch(value), f"the CRD would admit {value!r}"
    with pytest.raises(SpecError, match=r"spec\.checkpoint\.resumeFrom="):
        job(value)


def test_an_empty_value_is_no_source() -> None:
    assert job("").checkpoint.resume_from is None
    assert resume_source(job(""), "s3://bucket/jobs/ml/new-x") is None


def test_the_operators_patterns_are_the_crds() -> None:
    """spec.py checks a job stored before the CRD had the rule with the CRD's own pattern:
    the URI part is spec.checkpoint.uri's, the name part metadata.name's."""
    assert FIELD["pattern"] == f"^({URI_PATTERN.pattern}|{NAME_PATTERN.pattern})$"
    assert SCHEMA["properties"]["uri"]["pattern"] == f"^{URI_PATTERN.pattern}$"


def test_the_crd_describes_the_field_and_fixes_it_for_the_jobs_life() -> None:
    assert "resharded" in FIELD["description"] and "never written" in FIELD["description"]
    rules = [r for r in SCHEMA["x-kubernetes-validations"] if r.get("fieldPath") == ".resumeFrom"]
    assert len(rules) == 1 and "oldSelf.resumeFrom" in rules[0]["rule"]
    assert "spec.checkpoint.resumeFrom cannot change" in rules[0]["message"]
    assert checkpoint_schema(CRD_PATHS[1]) == SCHEMA  # the chart's copy


def test_a_name_maps_to_every_location_that_name_had_beside_the_jobs_own() -> None:
    spec = job("train")
    own = job_checkpoint_uri(spec, "ml", "train", "11111111-2222-3333-4444-555555555555")
    assert resume_source(spec, own) == ResumeSource("s3://bucket/jobs/ml", job="train")
    # the pinned location (status.storage) decides, as for the job's own saves
    pinned = f"s3://old-bucket/x/ml/retry-{UID}/"
    assert resume_source(spec, pinned) == ResumeSource("s3://old-bucket/x/ml", job="train")


def test_a_location_is_taken_as_it_is() -> None:
    location = f"s3://other/jobs/research/train-{UID}"
    assert resume_source(job(location), "s3://bucket/jobs/ml/new-x") == ResumeSource(location)
    assert resume_source(job(None), "s3://bucket/jobs/ml/new-x") is None


def build(spec: JobSpec) -> dict[str, Any]:
    body = {"metadata": {"name": "new", "namespace": "ml", "uid": UID}}
    uri = job_checkpoint_uri(spec, "ml", "new", UID)
    return builders.build_pod(body, spec, uri=uri, attempt=1, world_size=2, node_rank=1)


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_trainer_alone_gets_the_source_and_its_config_reads_it_back() -> None:
    pod = build(job("train"))
    trainer = env_of(pod["spec"]["containers"][0])
    assert trainer[Env.RESUME_FROM] == "s3://bucket/jobs/ml"
    assert trainer[Env.RESUME_FROM_JOB] == "train"
    assert trainer[Env.CHECKPOINT_URI] == f"s3://bucket/jobs/ml/new-{UID}"  # saves: its own
    sidecar = env_of(pod["spec"]["initContainers"][-1])
    assert Env.RESUME_FROM not in sidecar and Env.RESUME_FROM_JOB not in sidecar
    config = CheckpointConfig.from_env(trainer)
    assert (config.resume_from, config.resume_from_job) == ("s3://bucket/jobs/ml", "train")
    assert config.uri == f"s3://bucket/jobs/ml/new-{UID}"


def test_a_location_travels_alone_and_no_source_sets_nothing() -> None:
    location = f"s3://bucket/jobs/ml/train-{UID}"
    trainer = env_of(build(job(location))["spec"]["containers"][0])
    assert trainer[Env.RESUME_FROM] == location and Env.RESUME_FROM_JOB not in trainer
    assert CheckpointConfig.from_env(trainer).resume_from_job is None
    plain = env_of(build(job(None))["spec"]["containers"][0])
    assert Env.RESUME_FROM not in plain and Env.RESUME_FROM_JOB not in plain
