"""What a failed S3 call means: retry it, or which one-line error to give (no I/O).

By exception type and S3 error code, never by message text; ``describe`` gives
a few words for a message (status and code, or the errno's name), never the
exception's text, which may quote a request.
"""

from __future__ import annotations

import builtins
import enum
import http.client
import os
import random
import socket
from urllib.parse import urlsplit, urlunsplit

import botocore.exceptions as bex
import urllib3.exceptions

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}
_NOT_IMPLEMENTED = {"NotImplemented", "501"}
_TRANSIENT_CODES = {
    # botocore's transient and throttling codes, and the 5xx codes S3 sends in
    # DeleteObjects' per-key errors (which arrive in a 200 reply)
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "InternalError",
    "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "RequestThrottled", "OperationAborted",
}  # fmt: skip
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "403",
}


class Failure(enum.Enum):
    """What a failed S3 call means for us; the first three are retried."""

    UNREACHABLE = "unreachable"  # no reply at all: refused, reset, closed, connect timeout
    TRANSIENT = "transient"  # 5xx, throttling, read timeout, a body broken or cut short
    CONFLICT = "conflict"  # 409: a conditional write raced another
    NOT_FOUND = "not-found"
    EXISTS = "exists"  # 412 on a create-only write
    NOT_IMPLEMENTED = "not-implemented"  # the server lacks a feature (501)
    NO_BUCKET = "no-bucket"
    BAD_CREDENTIALS = "bad-credentials"
    NO_CREDENTIALS = "no-credentials"
    TLS = "tls"  # a certificate problem: retrying cannot fix it
    OTHER = "other"

    @property
    def retryable(self) -> bool:
        return self in (Failure.UNREACHABLE, Failure.TRANSIENT, Failure.CONFLICT)


class ShortBody(Exception):
    """A GET body ended before the response's Content-Length."""

    def __init__(self, got: int, expected: int) -> None:
        super().__init__(f"{got} of {expected} bytes")
        self.got = got
        self.expected = expected


def _code_and_status(exc: bex.ClientError) -> tuple[str, int]:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return code, status


def classify(exc: BaseException) -> Failure:
    """By exception type and S3 error code (never by message text)."""
    if isinstance(exc, bex.ClientError):
        code, status = _code_and_status(exc)
        for codes, failure in (
            (_NOT_FOUND, Failure.NOT_FOUND),
            (_EXISTS, Failure.EXISTS),
            (_CONFLICT, Failure.CONFLICT),
            (_NOT_IMPLEMENTED, Failure.NOT_IMPLEMENTED),
            ({"NoSuchBucket"}, Failure.NO_BUCKET),
            (_BAD_CREDENTIALS, Failure.BAD_CREDENTIALS),
            (_TRANSIENT_CODES, Failure.TRANSIENT),
        ):
            if code in codes:
                return failure
        if status == 501:
            return Failure.NOT_IMPLEMENTED
        return Failure.TRANSIENT if status >= 500 else Failure.OTHER
    if isinstance(exc, bex.NoCredentialsError | bex.PartialCredentialsError):
        return Failure.NO_CREDENTIALS
    if isinstance(exc, bex.SSLError):
        return Failure.TLS
    if isinstance(exc, bex.ConnectionError | bex.ConnectionClosedError | ConnectionRefusedError):
        return Failure.UNREACHABLE  # EndpointConnectionError, ConnectTimeoutError, proxy
    if isinstance(
        exc,
        bex.HTTPClientError  # ReadTimeoutError, ResponseStreamingError, ...
        | bex.IncompleteReadError
        | ShortBody
        | urllib3.exceptions.ProtocolError
        | urllib3.exceptions.ReadTimeoutError
        | http.client.IncompleteRead
        | ConnectionError
        | TimeoutError,
    ):
        return Failure.TRANSIENT
    return Failure.OTHER


def describe(exc: BaseException) -> str:
    """A few words for a message: status and code, or the errno's name, never the
    exception's text (which may quote a request)."""
    if isinstance(exc, bex.ClientError):
        code, status = _code_and_status(exc)
        return f"{status} {code}".strip() if status >= 300 else code or "error"
    if isinstance(exc, ShortBody):
        return f"body cut short, {exc.got} of {exc.expected} bytes"
    if isinstance(exc, bex.IncompleteReadError):
        got, want = exc.kwargs.get("actual_bytes"), exc.kwargs.get("expected_bytes")
        return f"body cut short, {got} of {want} bytes"
    seen: builtins.list[BaseException] = [exc]
    for e in seen:  # the errno of a wrapped socket error: "connection reset by peer"
        if isinstance(e, http.client.IncompleteRead):  # urllib3's too
            return "body cut short"
        if isinstance(e, socket.gaierror):
            return "cannot resolve the host name"
        if isinstance(e, OSError) and e.errno and e.errno > 0:
            return os.strerror(e.errno).lower()
        nested = [*getattr(e, "kwargs", {}).values(), *e.args, e.__cause__, e.__context__]
        seen.extend(n for n in nested if isinstance(n, BaseException) and n not in seen)
    for cls, words in (
        (bex.ConnectTimeoutError, "connect timeout"),
        (bex.ReadTimeoutError, "read timeout"),
        (bex.EndpointConnectionError, "cannot connect"),
        (bex.ConnectionClosedError, "connection closed"),
        (bex.ResponseStreamingError, "response stream broken"),
        (urllib3.exceptions.ProtocolError, "connection broken"),
    ):
        if isinstance(exc, cls):
            return words
    return type(exc).__name__


def backoff_s(attempt: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2^(attempt-1))] after attempt `attempt`."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** (attempt - 1)))


def redact(url: str) -> str:
    """The endpoint URL without any user:password@ in it."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
