"""What the engine relies on from an S3 server, checked against each server we run.

Servers: moto (the fast default), SeaweedFS (built from its Go module; what users may
run), and any other given by ``CTJ_S3_CONFORMANCE_ENDPOINT`` (with the usual AWS_*
credentials in the environment), e.g. a team's MinIO, Ceph RGW or AWS S3 bucket:

    CTJ_S3_CONFORMANCE_ENDPOINT=https://s3.example.com ./hack/test.sh \\
        tests/integration/test_s3_conformance.py

The semantics (docs/s3-servers.md has what each server does):

- a create-only PUT (``If-None-Match: *``) is refused (412) when the key exists, and of
  several racing for one key exactly one wins: the commit's fencing (DESIGN, Fencing);
- a PUT whose ``x-amz-checksum-crc32`` does not match its body is refused, so a body
  corrupted on the way is never stored (every chunk and manifest PUT carries one);
- a ranged GET returns exactly the bytes asked for (resharded loads read slices);
- LIST (v2, paged) sees a PUT or a DeleteObjects as soon as it returned (``ls``, gc and
  the fallback to an older checkpoint list).
"""

from __future__ import annotations

import base64
import os
import threading
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from trainer_sidecar.errors import ObjectExists
from trainer_sidecar.store.s3 import S3Settings, S3Store, open_store

pytestmark = pytest.mark.integration
SERVERS = ["moto", "seaweedfs"] + (
    ["external"] if os.environ.get("CTJ_S3_CONFORMANCE_ENDPOINT") else []
)
DEVIATIONS = {
    ("moto", "crc32"): "moto stores a body whose x-amz-checksum-crc32 does not match it",
}
"""What a server is known to do otherwise (docs/s3-servers.md): a strict xfail, so the day
it conforms, the table (and the docs) must change."""


def _known_deviation(request: pytest.FixtureRequest, what: str) -> None:
    server = request.node.callspec.params["server_env"]
    reason = DEVIATIONS.get((server, what))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


@pytest.fixture(params=SERVERS)
def server_env(request: pytest.FixtureRequest, s3_endpoint: str) -> dict[str, str]:
    """Endpoint and credentials of one server."""
    if request.param == "moto":
        return {
            "AWS_ENDPOINT_URL": s3_endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }
    if request.param == "seaweedfs":
        return request.getfixturevalue("seaweedfs").env()
    return {
        "AWS_ENDPOINT_URL": os.environ["CTJ_S3_CONFORMANCE_ENDPOINT"],
        **{
            k: os.environ[k]
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")
            if k in os.environ
        },
    }


def _client(env: dict[str, str]) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        region_name=env.get("AWS_REGION", "us-east-1"),
    )


@pytest.fixture
def bucket(server_env: dict[str, str]) -> Iterator[tuple[Any, str]]:
    """(client, a fresh bucket), emptied and removed after."""
    s3 = _client(server_env)
    name = f"ctj-conf-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=name)
    try:
        yield s3, name
    finally:
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=name).get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=name, Delete={"Objects": [{"Key": k} for k in keys]})
        s3.delete_bucket(Bucket=name)


def _code(exc: ClientError) -> str:
    return str(exc.response["Error"]["Code"])


def _status(exc: ClientError) -> int:
    return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])


def _crc(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def test_a_create_only_put_is_refused_when_the_key_exists(bucket: tuple[Any, str]) -> None:
    s3, name = bucket
    s3.put_object(Bucket=name, Key="manifest", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=name, Key="manifest", Body=b"second", IfNoneMatch="*")
    assert _status(refused.value) == 412, refused.value.response
    assert s3.get_object(Bucket=name, Key="manifest")["Body"].read() == b"first"


def test_of_racing_create_only_puts_exactly_one_wins(bucket: tuple[Any, str]) -> None:
    """Two attempts' committers (or a straggler) racing for one commit key."""
    s3, name = bucket
    writers = 6
    for round_ in range(5):
        key = f"commit-{round_}"
        barrier = threading.Barrier(writers)
        outcome: dict[int, str] = {}

        def put(
            i: int,
            key: str = key,
            barrier: threading.Barrier = barrier,
            outcome: dict[int, str] = outcome,
        ) -> None:
            client = _client_like(s3)
            barrier.wait()
            try:
                body = f"writer {i}".encode()
                client.put_object(Bucket=name, Key=key, Body=body, IfNoneMatch="*")
                outcome[i] = "won"
            except ClientError as exc:
                outcome[i] = f"{_status(exc)} {_code(exc)}"

        threads = [threading.Thread(target=put, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [i for i, o in outcome.items() if o == "won"]
        assert len(outcome) == writers
        assert len(winners) == 1, f"round {round_}: {outcome}"
        # a loser sees 412, or 409 ConditionalRequestConflict (our store retries it: 412)
        assert all(o.startswith(("412", "409")) for i, o in outcome.items() if i != winners[0])
        body = s3.get_object(Bucket=name, Key=key)["Body"].read()
        assert body == f"writer {winners[0]}".encode(), "the stored body is the winner's"


def _client_like(s3: Any) -> Any:
    """A client of its own per thread, for the same server and credentials."""
    creds = s3._request_signer._credentials  # noqa: SLF001 - same identity, new connection pool
    return boto3.client(
        "s3",
        endpoint_url=s3.meta.endpoint_url,
        aws_access_key_id=creds.access_key,
        aws_secret_access_key=creds.secret_key,
        region_name=s3.meta.region_name,
    )


def test_a_put_with_a_wrong_crc32_is_refused(
    bucket: tuple[Any, str], request: pytest.FixtureRequest
) -> None:
    """Where a server does not check it, a body corrupted on its way is stored, and found
    only when read (our BLAKE3 block hashes), which falls back to an older checkpoint."""
    _known_deviation(request, "crc32")
    s3, name = bucket
    body = os.urandom(64 * 1024)
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=name, Key="chunk", Body=body, ChecksumCRC32=_crc(body + b"x"))
    assert _status(refused.value) == 400, refused.value.response
    with pytest.raises(ClientError) as missing:
        s3.head_object(Bucket=name, Key="chunk")
    assert _status(missing.value) == 404, "nothing stored"
    s3.put_object(Bucket=name, Key="chunk", Body=body, ChecksumCRC32=_crc(body))
    assert s3.get_object(Bucket=name, Key="chunk")["Body"].read() == body


def test_a_ranged_get_returns_exactly_the_range(bucket: tuple[Any, str]) -> None:
    s3, name = bucket
    body = os.urandom(3 * 1024 * 1024 + 17)
    s3.put_object(Bucket=name, Key="chunk", Body=body)
    ranges = [(0, 1), (5, 4096), (2**20 - 3, 2**21 + 5), (len(body) - 1, len(body))]
    for start, end in ranges:
        resp = s3.get_object(Bucket=name, Key="chunk", Range=f"bytes={start}-{end - 1}")
        assert resp["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert resp["ContentLength"] == end - start
        assert resp["Body"].read() == body[start:end], (start, end)


def test_list_sees_puts_and_deletes_at_once_and_pages(bucket: tuple[Any, str]) -> None:
    s3, name = bucket
    keys = [f"ckpt/step-{i:04d}/part" for i in range(25)]
    for i, key in enumerate(keys):
        s3.put_object(Bucket=name, Key=key, Body=b"x" * i)
        listed = s3.list_objects_v2(Bucket=name, Prefix="ckpt/")
        assert key in {o["Key"] for o in listed.get("Contents", [])}, f"{key} not listed at once"

    def all_keys() -> list[str]:
        found: list[str] = []
        args: dict[str, Any] = {"Bucket": name, "Prefix": "ckpt/", "MaxKeys": 10}
        while True:
            page = s3.list_objects_v2(**args)
            found += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return found
            args["ContinuationToken"] = page["NextContinuationToken"]

    assert all_keys() == keys, "pages cover every key once, in order"
    gone = keys[3:8]
    s3.delete_objects(Bucket=name, Delete={"Objects": [{"Key": k} for k in gone]})
    assert all_keys() == [k for k in keys if k not in gone]


def test_our_store_accepts_the_server(
    server_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, bucket: tuple[Any, str]
) -> None:
    """The engine's own probe of conditional writes passes, and its operations work."""
    _, name = bucket
    for k, v in server_env.items():
        monkeypatch.setenv(k, v)
    store = open_store(f"s3://{name}/jobs/probe", S3Settings.from_env())
    assert isinstance(store, S3Store)
    store.check_conditional_writes()
    store.put("a", b"payload", if_absent=True)
    with pytest.raises(ObjectExists):
        store.put("a", b"other", if_absent=True)
    assert store.get("a") == b"payload" and store.get("a", byte_range=(2, 5)) == b"ylo"
    assert [o.key for o in store.list("")] == ["a"], "the probe cleaned up after itself"
