"""S3 failures in our vocabulary: what is retried, what each final failure raises (no server)."""

from __future__ import annotations

import datetime
import io
import random
from collections.abc import Callable
from typing import Any

import botocore.exceptions as bex
import pytest
import urllib3.exceptions
from botocore.response import StreamingBody

from trainer_sidecar.errors import (
    CheckpointError,
    ObjectExists,
    ObjectNotFound,
    StoreUnavailable,
)
from trainer_sidecar.store.base import Location
from trainer_sidecar.store.s3 import ALLOW_UNCONDITIONAL_ENV, S3Settings, S3Store
from trainer_sidecar.store.s3_errors import Failure, ShortBody, backoff_s, classify, describe

ENDPOINT = "http://s3.example:9000"
SECRET = "wJalrXUtnFEMI-not-for-messages"


def client_error(code: str, status: int, op: str = "GetObject") -> bex.ClientError:
    return bex.ClientError(
        {"Error": {"Code": code, "Message": f"{SECRET} (server text)"},
         "ResponseMetadata": {"HTTPStatusCode": status}},
        op,
    )  # fmt: skip


reset = ConnectionResetError(104, "Connection reset by peer")
CASES: list[tuple[BaseException, Failure]] = [
    (client_error("SlowDown", 503), Failure.TRANSIENT),
    (client_error("ServiceUnavailable", 503), Failure.TRANSIENT),
    (client_error("InternalError", 500), Failure.TRANSIENT),
    (client_error("BadGateway", 502), Failure.TRANSIENT),  # any 5xx by its status
    (client_error("503", 503, "HeadObject"), Failure.TRANSIENT),  # HEAD: no body, no code
    (client_error("RequestTimeout", 400), Failure.TRANSIENT),
    (client_error("Throttling", 400), Failure.TRANSIENT),
    (client_error("InternalError", 0, "DeleteObjects"), Failure.TRANSIENT),  # a per-key error
    (client_error("ConditionalRequestConflict", 409, "PutObject"), Failure.CONFLICT),
    (client_error("PreconditionFailed", 412, "PutObject"), Failure.EXISTS),
    (client_error("NoSuchKey", 404), Failure.NOT_FOUND),
    (client_error("404", 404, "HeadObject"), Failure.NOT_FOUND),
    (client_error("NoSuchBucket", 404), Failure.NO_BUCKET),
    (client_error("AccessDenied", 403), Failure.BAD_CREDENTIALS),
    (client_error("SignatureDoesNotMatch", 403), Failure.BAD_CREDENTIALS),
    (client_error("NotImplemented", 501, "PutObject"), Failure.NOT_IMPLEMENTED),
    (client_error("InvalidRange", 416), Failure.OTHER),
    (client_error("InvalidArgument", 400), Failure.OTHER),
    (bex.EndpointConnectionError(endpoint_url=ENDPOINT), Failure.UNREACHABLE),
    (bex.ConnectTimeoutError(endpoint_url=ENDPOINT), Failure.UNREACHABLE),
    (bex.ConnectionClosedError(endpoint_url=ENDPOINT), Failure.UNREACHABLE),
    (bex.ReadTimeoutError(endpoint_url=ENDPOINT), Failure.TRANSIENT),
    (bex.ResponseStreamingError(error=urllib3.exceptions.ProtocolError("x")), Failure.TRANSIENT),
    (bex.IncompleteReadError(actual_bytes=3, expected_bytes=5), Failure.TRANSIENT),
    (ShortBody(3, 5), Failure.TRANSIENT),
    (urllib3.exceptions.ProtocolError("Connection broken", reset), Failure.TRANSIENT),
    (urllib3.exceptions.ReadTimeoutError(None, "/", "timed out"), Failure.TRANSIENT),  # type: ignore[arg-type]
    (reset, Failure.TRANSIENT),
    (bex.SSLError(endpoint_url=ENDPOINT, error="bad certificate"), Failure.TLS),
    (bex.NoCredentialsError(), Failure.NO_CREDENTIALS),
    (ValueError("a bug"), Failure.OTHER),
]


@pytest.mark.parametrize(
    ("exc", "want"), CASES, ids=[f"{type(e).__name__}-{w.value}" for e, w in CASES]
)
def test_classify(exc: BaseException, want: Failure) -> None:
    assert classify(exc) is want


def test_only_no_reply_transient_and_conflict_are_retried() -> None:
    assert {f for f in Failure if f.retryable} == {
        Failure.UNREACHABLE, Failure.TRANSIENT, Failure.CONFLICT
    }  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (client_error("SlowDown", 503), "503 SlowDown"),
        (client_error("InternalError", 0, "DeleteObjects"), "InternalError"),
        (bex.ConnectionClosedError(endpoint_url=ENDPOINT, error=reset), "connection reset by peer"),
        (bex.IncompleteReadError(actual_bytes=3, expected_bytes=5), "body cut short, 3 of 5 bytes"),
        (bex.ConnectTimeoutError(endpoint_url=ENDPOINT), "connect timeout"),
        (bex.ReadTimeoutError(endpoint_url=ENDPOINT), "read timeout"),
    ],
)
def test_describe_names_the_code_or_errno_never_the_text(exc: BaseException, words: str) -> None:
    assert describe(exc) == words


def test_backoff_is_capped_jittered_and_grows() -> None:
    rng = random.Random(1)
    delays = [[backoff_s(a, base_s=0.5, cap_s=4.0, rng=rng) for _ in range(200)] for a in (1, 3, 9)]
    assert all(0 <= d <= 0.5 for d in delays[0])
    assert all(0 <= d <= 2.0 for d in delays[1])
    assert all(0 <= d <= 4.0 for d in delays[2])  # capped
    assert max(delays[2]) > 3.0 and len(set(delays[2])) == 200  # jittered over the range


def test_allow_unconditional_writes_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert S3Settings.from_env().allow_unconditional_writes is False
    monkeypatch.setenv(ALLOW_UNCONDITIONAL_ENV, "1")
    assert S3Settings.from_env().allow_unconditional_writes is True
    monkeypatch.setenv(ALLOW_UNCONDITIONAL_ENV, "maybe")
    with pytest.raises(CheckpointError, match=ALLOW_UNCONDITIONAL_ENV):
        S3Settings.from_env()


# -- the retry loop, over a client that fails as scripted ----------------------------


class ScriptedClient:
    """Answers like S3 from a dict, after raising the scripted failures (one per call)."""

    def __init__(self, failures: list[BaseException | Callable[[], Any]]) -> None:
        self.failures = list(failures)
        self.objects: dict[str, bytes] = {}
        self.calls = 0
        self.meta = None

    def _next(self) -> Any:
        self.calls += 1
        if self.failures:
            failure = self.failures.pop(0)
            if isinstance(failure, BaseException):
                raise failure
            return failure()
        return None

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        scripted = self._next()
        if scripted is not None:
            return scripted
        if Key not in self.objects:
            raise client_error("NoSuchKey", 404)
        data = self.objects[Key]
        if Range:
            start, end = (int(x) for x in Range.removeprefix("bytes=").split("-"))
            data = data[start : end + 1]
        return {"Body": StreamingBody(io.BytesIO(data), len(data)), "ContentLength": len(data)}

    def put_object(self, *, Key: str, Body: Any, IfNoneMatch: str | None = None, **_: Any) -> None:
        self._next()
        if IfNoneMatch == "*" and Key in self.objects:
            raise client_error("PreconditionFailed", 412, "PutObject")
        self.objects[Key] = bytes(Body) if isinstance(Body, bytes) else Body.read()

    def delete_objects(self, *, Delete: dict[str, Any], **_: Any) -> dict[str, Any]:
        scripted = self._next()
        for obj in Delete["Objects"]:
            self.objects.pop(obj["Key"], None)
        return scripted or {}

    def list_objects_v2(self, **_: Any) -> dict[str, Any]:
        self._next()
        return {"Contents": [], "IsTruncated": False}


def store_with(client: ScriptedClient, max_attempts: int = 3) -> S3Store:
    settings = S3Settings(endpoint_url=ENDPOINT, max_attempts=max_attempts, backoff_base_s=0)
    store = S3Store(
        Location.parse("s3://bkt1/jobs/a"),
        settings,
        credentials={"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET},
    )
    store._s3 = client
    return store


def short_stream() -> dict[str, Any]:
    """What botocore hands back when the server closes 3 bytes into a 5-byte body."""
    return {"Body": StreamingBody(io.BytesIO(b"abc"), 5), "ContentLength": 5}


def test_get_retries_broken_and_short_bodies_then_returns_the_bytes() -> None:
    client = ScriptedClient([
        bex.ResponseStreamingError(error=urllib3.exceptions.ProtocolError("broken", reset)),
        bex.ReadTimeoutError(endpoint_url=ENDPOINT),
        short_stream,  # botocore's own length check: IncompleteReadError
        lambda: {"Body": io.BytesIO(b"abc"), "ContentLength": 5},  # ours: ShortBody
        client_error("SlowDown", 503),
    ])  # fmt: skip
    store = store_with(client, max_attempts=6)
    client.objects["jobs/a/k"] = b"hello"
    assert store.get("k") == b"hello"
    assert client.calls == 6
    assert store.get("k", byte_range=(1, 4)) == b"ell"


def test_exhausted_retries_raise_store_unavailable_naming_the_endpoint_and_last_error() -> None:
    client = ScriptedClient([bex.ReadTimeoutError(endpoint_url=ENDPOINT)] * 2 + [short_stream])
    with pytest.raises(StoreUnavailable) as info:
        store_with(client).get("k")
    message = str(info.value)
    assert client.calls == 3
    assert "\n" not in message and ENDPOINT in message and "after 3 attempts" in message
    assert "body cut short, 3 of 5 bytes" in message
    assert SECRET not in message and "AKIDEXAMPLE" not in message


def test_an_endpoint_that_never_answers_is_unreachable() -> None:
    client = ScriptedClient([bex.EndpointConnectionError(endpoint_url=ENDPOINT)] * 3)
    with pytest.raises(StoreUnavailable, match=r"unreachable after 3 attempts \(last: cannot"):
        store_with(client).put("k", b"x")


@pytest.mark.parametrize(
    ("failure", "raised"),
    [
        (client_error("NoSuchKey", 404), ObjectNotFound),
        (client_error("NoSuchBucket", 404), CheckpointError),
        (client_error("AccessDenied", 403), CheckpointError),
        (client_error("InvalidRange", 416), CheckpointError),
        (bex.NoCredentialsError(), CheckpointError),
        (ValueError("a bug keeps its traceback"), ValueError),
    ],
)
def test_final_failures_are_not_retried(failure: BaseException, raised: type) -> None:
    client = ScriptedClient([failure])
    with pytest.raises(raised) as info:
        store_with(client).get("k")
    assert client.calls == 1
    assert type(info.value) is not StoreUnavailable
    assert SECRET not in str(info.value)


def test_a_conditional_conflict_is_retried_and_then_412_means_exists() -> None:
    client = ScriptedClient([])
    store = store_with(client, max_attempts=6)
    store.check_conditional_writes()  # the probe: put, refused put, delete
    assert client.calls == 3 and not client.objects
    store.put("manifest", b"first", if_absent=True)
    conflict = client_error("ConditionalRequestConflict", 409, "PutObject")
    client.failures = [conflict, conflict]
    before = client.calls
    with pytest.raises(ObjectExists):
        store.put("manifest", b"second", if_absent=True)
    assert client.calls - before == 3
    assert client.objects["jobs/a/manifest"] == b"first"


def test_delete_retries_per_key_errors_of_a_200_reply() -> None:
    client = ScriptedClient([lambda: {"Errors": [{"Key": "jobs/a/k", "Code": "InternalError"}]}])
    store = store_with(client)
    client.objects["jobs/a/k"] = b"x"
    store.delete(["k"])
    assert client.calls == 2 and not client.objects
    client.failures = [lambda: {"Errors": [{"Key": "jobs/a/k", "Code": "AccessDenied"}]}]
    with pytest.raises(CheckpointError, match="refused our credentials"):
        store.delete(["k"])


def test_the_endpoint_is_named_without_its_userinfo() -> None:
    settings = S3Settings(endpoint_url="http://user:pa55@s3.example:9000", max_attempts=1)
    store = S3Store(Location.parse("s3://bkt1/a"), settings)
    store._s3 = ScriptedClient([bex.EndpointConnectionError(endpoint_url="x")])
    with pytest.raises(StoreUnavailable) as info:
        store.get("k")
    assert "pa55" not in str(info.value) and "http://s3.example:9000" in str(info.value)


def test_list_retries_a_failed_page_and_yields_every_key_once() -> None:
    modified = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    pages = iter([
        {"Contents": [{"Key": "jobs/a/m/1", "Size": 1, "LastModified": modified}],
         "IsTruncated": True, "NextContinuationToken": "t1"},
        {"Contents": [{"Key": "jobs/a/m/2", "Size": 2, "LastModified": modified}],
         "IsTruncated": False},
    ])  # fmt: skip
    tokens: list[str | None] = []
    client = ScriptedClient([])

    def list_objects_v2(*, ContinuationToken: str | None = None, **_: Any) -> dict[str, Any]:
        client._next()
        tokens.append(ContinuationToken)
        return next(pages)

    client.list_objects_v2 = list_objects_v2  # type: ignore[method-assign]
    store = store_with(client)
    first = store.list("m/")
    assert next(first).key == "m/1"
    client.failures = [bex.ReadTimeoutError(endpoint_url=ENDPOINT)]  # the second page, once
    assert [(o.key, o.size) for o in first] == [("m/2", 2)]
    assert tokens == [None, "t1"] and client.calls == 3
