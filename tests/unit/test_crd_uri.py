"""spec.checkpoint.uri: the CRD refuses at `kubectl apply` exactly what the pods' URI
parser (trainer_sidecar.store.base.uri_problem) would refuse at run time, so a job is
never accepted only to fail in its pods. The API server matches OpenAPI patterns with
RE2; the pattern uses nothing that Python's re and RE2 read differently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from trainer_sidecar.store.base import uri_problem

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "training.ctj.dev_checkpointedtrainingjobs.yaml").read_text())
SPEC = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
PATTERN = re.compile(SPEC["properties"]["checkpoint"]["properties"]["uri"]["pattern"])

GOOD = [
    "s3://bucket",
    "s3://bucket/",
    "s3://bucket/prefix",
    "s3://bucket/prefix/",
    "s3://my.bucket-1/a/b_c/d",
    "file:///tmp/ckpt",
    "file://localhost/tmp/ckpt",
    "file:///",
]
BAD = [
    "s3:/bucket/x",  # one slash: a relative path to the old parser, created
    "s3://",
    "s3://b/a//c",
    "s3://b/./c",
    "s3://b/../c",
    "s3://b/x/..",
    "s3://user:secret@b/x",
    "s3://b/x?versionId=1",
    "s3://b/x#frag",
    "s3://b:9000/x",
    "file://host/tmp/x",
    "gs://bucket/x",
    "bucket/x",
]


@pytest.mark.parametrize("uri", GOOD)
def test_the_crd_admits_what_the_pods_can_use(uri: str) -> None:
    assert uri_problem(uri) is None
    assert PATTERN.fullmatch(uri), f"the CRD would refuse {uri!r}, which the pods accept"


@pytest.mark.parametrize("uri", BAD)
def test_the_crd_refuses_what_the_pods_would_refuse(uri: str) -> None:
    assert not PATTERN.fullmatch(uri), f"the CRD would admit {uri!r}"
    if "://" in uri:  # a plain path is a local directory to the CLI, not a job's URI
        assert uri_problem(uri) is not None
