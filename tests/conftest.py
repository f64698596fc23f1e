"""Fixtures shared by every test tier: a real S3 server on loopback, fresh buckets."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from trainer_sidecar.local_s3 import LocalS3, free_port, wait_for_port

__all__ = ["ROOT", "free_port", "wait_for_port"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 server (moto's server mode) on loopback, for the whole session."""
    server = LocalS3.start()
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment a job gets: endpoint and (test) credentials, never in a URI."""
    env = {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def s3_uri(s3_env: dict[str, str]) -> str:
    """A fresh bucket on the loopback S3 server, as a checkpoint URI with a prefix."""
    import boto3

    bucket = f"ctj-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/jobs/test"
