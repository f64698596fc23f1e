"""S3 (and MinIO, SeaweedFS, Ceph RGW, ...) as an object store, through boto3.

Credentials come from boto3's standard chain (environment, shared files, IRSA,
instance metadata); they are never taken from a URI, logged, put in a metric or
in an error message (messages name error codes and errno strings, never the
text of an exception, and the endpoint without any user:password in it).
Every chunk is at most 64 MiB, so each is one PUT; parallelism comes from the
caller uploading many chunks at once (the chunks are the parts).

Retries are ours, not botocore's: its "standard" mode retries a request that
fails (throttling, 5xx, connection errors) but not a GET whose body breaks
while it streams (a reset, a read timeout, a body shorter than its
Content-Length), and a chunk-sized read spends most of its time streaming.
Its retries are off, so attempts are counted once and never multiply. One
loop (`S3Store._retrying`) retries every operation on the failures `classify`
calls retryable, by exception type and S3 error code, never by message text:
no connection, a reset or close before a reply, timeouts, a broken or short
body, 5xx except 501, throttling codes, RequestTimeout, and 409
ConditionalRequestConflict (two conditional writes raced; retried, after which
a 412 means the object exists). Backoff is capped, fully jittered exponential,
up to `S3Settings.max_attempts` attempts in all; then `StoreUnavailable`, one
line naming the endpoint and the last error.
A create-only PUT retried after a reply was lost may find its own object and
raise ObjectExists: a committer reads the object back to tell (DESIGN, Fencing).

Conditional writes are probed, not assumed: some S3-compatible servers ignore
If-None-Match. The first create-only put of a store PUTs a probe object twice
(`check_conditional_writes`); where the second is accepted, commits are refused
unless CTJ_S3_ALLOW_UNCONDITIONAL_WRITES=1 opts into check-then-write.

Integrity on the way in: every PUT carries a CRC32 of its body
(x-amz-checksum-crc32, checked by the server) instead of a SHA-256 of the
body in its signature: four times cheaper on the CPU that trains (the request
itself is still signed). That is the AWS CRT client's choice too. On the way
out our own BLAKE3 block hashes verify every byte read, so botocore's response
checksums stay off.
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import functools
import http.client
import io
import logging
import os
import random
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions as bex
from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

from ..errors import CheckpointError, ObjectExists, ObjectNotFound, StoreUnavailable
from .base import Location, ObjectInfo
from .local import LocalStore
from .s3_errors import Failure, ShortBody, backoff_s, classify, describe, redact

log = logging.getLogger(__name__)
T = TypeVar("T")

PROBE_PREFIX = ".ctj-probe/"
ALLOW_UNCONDITIONAL_ENV = "CTJ_S3_ALLOW_UNCONDITIONAL_WRITES"
MAX_ATTEMPTS_ENV = "CTJ_S3_MAX_ATTEMPTS"


_ENDPOINT_FIX = "use http(s)://host[:port], e.g. http://minio:9000"
_REGION = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?")
"""botocore's rule for a region name: a client it would refuse is refused here, by name."""


def _flag(name: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise CheckpointError(f"{name}={value!r} is not a boolean: use 1 or 0")


def endpoint_problem(url: str) -> str | None:
    """Why ``url`` is no S3 endpoint, in words that never repeat it (it may carry a
    user:password); None when it is one."""
    if "://" not in url:
        return "has no scheme"
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed '[' of an IPv6 address
        return "is not a valid URL"
    if parts.scheme not in ("http", "https"):
        return f"has the scheme {parts.scheme!r}, not http or https"
    try:
        parts.port  # noqa: B018 - urlsplit parses the port only when asked
    except ValueError:
        return "has a port that is not a number from 0 to 65535"
    if not parts.hostname:
        return "names no host"
    if not (is_valid_endpoint_url(url) or is_valid_ipv6_endpoint_url(url)):
        return "is not a valid URL"
    return None


def shown_endpoint(url: str) -> str:
    """``url`` as an error may name it: without any user:password@, even where it does not
    parse."""
    try:
        return redact(url)
    except ValueError:
        scheme, sep, rest = url.partition("://")
        return scheme + sep + rest.rpartition("@")[2]


def region_problem(region: str) -> str | None:
    """Why ``region`` is no region name botocore accepts; None when it is one."""
    return None if _REGION.fullmatch(region) else "is not a region name"


def _setting(var: str, value: str, problem: str | None, fix: str) -> str:
    """``value`` of the environment variable ``var``, or the one-line error naming both."""
    if problem is not None:
        raise CheckpointError(f"{var}={shown_endpoint(value)!r} {problem}: {fix}")
    return value


def _attempts(var: str, value: str) -> int:
    fix = f"set {var} to the attempts per S3 request, first included: 1 or more (default 6)"
    try:
        attempts = int(value)
    except ValueError:
        raise CheckpointError(f"{var}={value!r} is not a whole number: {fix}") from None
    if attempts < 1:
        raise CheckpointError(f"{var}={value!r} is less than 1: {fix}")
    return attempts


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class S3Settings:
    """How to reach the S3 server; credentials are never part of this."""

    endpoint_url: str | None = None
    """e.g. http://minio:9000; None uses AWS (or AWS_ENDPOINT_URL)."""
    region: str | None = None
    """None uses AWS_REGION / AWS_DEFAULT_REGION, then us-east-1."""
    max_attempts: int = 6
    """Attempts per operation, first included (CTJ_S3_MAX_ATTEMPTS)."""
    max_connections: int = 16
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    backoff_base_s: float = 0.5
    """Retry n waits a random time up to min(cap, base * 2^(n-1))."""
    backoff_cap_s: float = 20.0
    allow_unconditional_writes: bool = False
    """Accept a server that ignores If-None-Match: a create-only put checks the key first,
    which does not exclude two racing committers (CTJ_S3_ALLOW_UNCONDITIONAL_WRITES)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise CheckpointError("s3 max_attempts must be >= 1")
        if self.endpoint_url is not None:
            problem = endpoint_problem(self.endpoint_url)
            if problem is not None:
                shown = shown_endpoint(self.endpoint_url)
                raise CheckpointError(f"S3 endpoint {shown!r} {problem}: {_ENDPOINT_FIX}")
        if self.region is not None and region_problem(self.region) is not None:
            raise CheckpointError(f"S3 region {self.region!r} is not a region name: e.g. us-east-1")
        if min(self.connect_timeout_s, self.read_timeout_s) <= 0:
            raise CheckpointError("s3 connect and read timeouts must be > 0 seconds")
        if not 0 <= self.backoff_base_s <= self.backoff_cap_s:
            raise CheckpointError("s3 backoff must satisfy 0 <= backoff_base_s <= backoff_cap_s")

    @classmethod
    def from_env(cls, **overrides: object) -> S3Settings:
        """AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION,
        CTJ_S3_MAX_ATTEMPTS and CTJ_S3_ALLOW_UNCONDITIONAL_WRITES, each checked here: a
        bad value is a one-line error naming the variable and the fix. ``overrides`` (not
        None) win over the environment."""
        env: dict[str, object] = {}
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(var):
                value = os.environ[var]
                env["endpoint_url"] = _setting(var, value, endpoint_problem(value), _ENDPOINT_FIX)
                break
        for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
            if os.environ.get(var):
                value = os.environ[var]
                fix = f"set {var} to one like us-east-1, or unset it"
                env["region"] = _setting(var, value, region_problem(value), fix)
                break
        if os.environ.get(MAX_ATTEMPTS_ENV):
            env["max_attempts"] = _attempts(MAX_ATTEMPTS_ENV, os.environ[MAX_ATTEMPTS_ENV])
        if os.environ.get(ALLOW_UNCONDITIONAL_ENV) is not None:
            env["allow_unconditional_writes"] = _flag(
                ALLOW_UNCONDITIONAL_ENV, os.environ[ALLOW_UNCONDITIONAL_ENV]
            )
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)  # type: ignore[arg-type]


def first_contact(settings: S3Settings) -> S3Settings:
    """``settings`` for a command's first request (``S3Store.check_reachable``): two
    attempts, a 2 s connect timeout, short backoff, so an endpoint that does not answer is
    reported within seconds, not after the minute a daemon's retries may wait out."""
    return dataclasses.replace(
        settings,
        max_attempts=min(settings.max_attempts, 2),
        max_connections=1,
        connect_timeout_s=min(settings.connect_timeout_s, 2.0),
        read_timeout_s=min(settings.read_timeout_s, 10.0),
        backoff_base_s=min(settings.backoff_base_s, 0.25),
        backoff_cap_s=min(settings.backoff_cap_s, 0.5),
    )


def crc32_header(data: bytes | memoryview) -> str:
    """x-amz-checksum-crc32: base64 of the big-endian CRC32, computed in place (no copy,
    and without the GIL: zlib releases it for large buffers)."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


class _ViewReader(io.RawIOBase):
    """A seekable file over a memoryview: botocore streams (and re-reads on retry) the
    staged bytes in place instead of a bytes copy of every in-flight chunk."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view.cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._pos)
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        """Let go of the staged bytes: a failed request (its traceback, a retry's leftovers)
        may outlive the call, and a live view would keep the slot's mapping open."""
        self._view.release()
        super().close()


def _socket_reader(body: Any) -> http.client.HTTPResponse | None:
    """The http.client response under a botocore body, when its bytes may be read from it
    directly: urllib3's own ``readinto`` reads into a new bytes and copies that (a second
    pass over every byte), http.client's lets the socket fill the caller's buffer. Private
    attributes of botocore (``_raw_stream``) and urllib3 (``_fp``), checked here; a version
    without them, or a body urllib3 would decode, is read the public way (test_s3_store
    fails if the pinned versions lose the direct path)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or not hasattr(raw, "release_conn"):
        return None
    assert raw is not None
    if raw.headers.get("content-encoding", "identity") != "identity":
        return None
    return fp


def _read_body_into(body: Any, views: Sequence[memoryview], size: int) -> int:
    """Read a GET's body of ``size`` bytes into ``views``, filling each before the next,
    until ``size`` bytes or the body's end; how many bytes. The connection goes back to the
    pool once the body is read to its end."""
    fp = _socket_reader(body)
    pos = 0
    for view in views:
        view = view[: max(0, min(view.nbytes, size - pos))]
        filled = 0
        while filled < view.nbytes:
            if fp is not None:
                n = fp.readinto(view[filled:])
            else:
                data = body.read(min(view.nbytes - filled, 1 << 20))
                n = len(data)
                view[filled : filled + n] = data
            if not n:
                break
            filled += n
        pos += filled
        if filled < view.nbytes:
            break
    if fp is not None and fp.isclosed():  # http.client closes itself at the body's end
        body._raw_stream.release_conn()
    return pos


class _NotImplemented(CheckpointError):
    """The server answered 501 NotImplemented (the probe reads it as "no conditional writes")."""


class S3Store:
    def __init__(
        self,
        location: Location,
        settings: S3Settings,
        *,
        credentials: dict[str, str] | None = None,
    ) -> None:
        """``credentials`` (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) override the chain:
        the operator reads a job's Secret; everything else uses the standard chain."""
        self.bucket = location.bucket
        self.prefix = f"{location.prefix}/" if location.prefix else ""
        self.settings = settings
        config = botocore.config.Config(
            # body integrity by put()'s CRC32 header, not by hashing the body into the signature
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            retries={"total_max_attempts": 1, "mode": "standard"},  # _retrying retries
            max_pool_connections=settings.max_connections,
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            request_checksum_calculation="when_required",  # put() sends its own CRC32
            response_checksum_validation="when_required",
        )
        region = (
            settings.region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1"
        )
        creds = credentials or {}
        try:
            session = boto3.session.Session(
                aws_access_key_id=creds.get("AWS_ACCESS_KEY_ID"),
                aws_secret_access_key=creds.get("AWS_SECRET_ACCESS_KEY"),
            )
            self._s3 = session.client(
                "s3", endpoint_url=settings.endpoint_url, region_name=region, config=config
            )
        except bex.ProfileNotFound as exc:
            raise CheckpointError(
                f"AWS_PROFILE={exc.kwargs.get('profile')!r} names no profile in the AWS config "
                "files: fix AWS_PROFILE, or unset it"
            ) from None
        except bex.ConfigParseError as exc:
            raise CheckpointError(
                f"cannot parse the AWS config file {exc.kwargs.get('path')}: fix it, or point "
                "AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE at another"
            ) from None
        self._location = location
        self._credentials = credentials
        self.endpoint = redact(settings.endpoint_url or self._s3.meta.endpoint_url)
        self.where = f"{location} at {self.endpoint}"
        self._rng = random.Random()
        self._probe_lock = threading.Lock()
        self._conditional: bool | None = None  # None: not probed yet
        self._warned_unconditional = False

    # -- retries and errors ---------------------------------------------------

    def _retrying(self, op: str, key: str, call: Callable[[], T]) -> T:
        """``call()``, again on a retryable failure, then that failure in our vocabulary."""
        attempt = 1
        started = time.monotonic()
        while True:
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - classified, translated or re-raised
                failure = classify(exc)
                if not failure.retryable or attempt >= self.settings.max_attempts:
                    spent = time.monotonic() - started
                    error = self._error(exc, failure, op, key, attempt, spent)
                    if error is exc:
                        raise
                    raise error from None
                delay = backoff_s(
                    attempt,
                    base_s=self.settings.backoff_base_s,
                    cap_s=self.settings.backoff_cap_s,
                    rng=self._rng,
                )
                log.debug(
                    "S3 %s %r: %s (attempt %d of %d); retrying in %.2fs",
                    op, key, describe(exc), attempt, self.settings.max_attempts, delay,
                )  # fmt: skip
                time.sleep(delay)
                attempt += 1

    def _error(
        self, exc: Exception, failure: Failure, op: str, key: str, attempts: int, spent: float
    ) -> Exception:
        """The exception to raise for a failure that is final (``exc`` itself for a bug)."""
        last = describe(exc)
        tries = f"after {attempts} attempt{'s' if attempts > 1 else ''}"
        tried = f"{op} in bucket {self.bucket!r}, {spent:.1f} s in all"  # what was tried
        if failure is Failure.NOT_FOUND:
            return ObjectNotFound(key)
        if failure is Failure.EXISTS:
            return ObjectExists(key)
        if failure is Failure.UNREACHABLE:
            return StoreUnavailable(
                f"the S3 endpoint {self.endpoint} is unreachable {tries} (last: {last}) for a "
                f"{tried}: check that it is up and that AWS_ENDPOINT_URL (or --endpoint-url) "
                "names it"
            )
        if failure is Failure.TRANSIENT:
            return StoreUnavailable(
                f"the S3 endpoint {self.endpoint} kept failing {tries} to {op} {key!r} "
                f"(last: {last}) in bucket {self.bucket!r}, {spent:.1f} s in all: it is "
                "overloaded or unwell; retry later"
            )
        if failure is Failure.CONFLICT:
            return StoreUnavailable(
                f"the S3 endpoint {self.endpoint} refused a conditional {op} of {key!r} as "
                f"conflicting {tries} (last: {last}): another writer keeps racing on it"
            )
        if failure is Failure.NOT_IMPLEMENTED:
            return _NotImplemented(
                f"the S3 server at {self.endpoint} does not implement {op} as we send it "
                f"({last}): use a server with full S3 support"
            )
        if failure is Failure.NO_BUCKET:
            return CheckpointError(
                f"bucket {self.bucket!r} does not exist at {self.endpoint}: "
                "create it or fix the URI"
            )
        if failure is Failure.BAD_CREDENTIALS:
            return CheckpointError(
                f"the S3 server refused our credentials for {self.where} ({last}): "
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the Secret they come from)"
            )
        if failure is Failure.NO_CREDENTIALS:
            return CheckpointError(
                "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or an AWS profile / role)"
            )
        if failure is Failure.TLS:
            return CheckpointError(
                f"TLS with the S3 endpoint {self.endpoint} failed: check its certificate "
                "(or AWS_CA_BUNDLE)"
            )
        if isinstance(exc, bex.ClientError):
            return CheckpointError(f"S3 error {last} on {op} {key!r} in {self.where}")
        return exc

    # -- first contact ------------------------------------------------------------

    def check_reachable(self) -> None:
        """Fail within seconds where the endpoint does not answer: one LIST of at most one
        key under the prefix, through a client of its own with ``first_contact`` settings.
        Any reply passes, an error reply too (a missing bucket, refused credentials, a busy
        server): the caller's own request then gives that error, or rides it out with these
        settings' patient retries. For a command's first contact (the CLI); the daemons,
        which must outlast an outage, never call it."""
        probe = S3Store(self._location, first_contact(self.settings), credentials=self._credentials)

        def once() -> None:
            try:
                probe._s3.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
            except bex.ClientError:
                return  # the server answered

        probe._retrying("LIST", "", once)

    # -- conditional writes -------------------------------------------------------

    def check_conditional_writes(self) -> None:
        """Probe once that the server honours If-None-Match (a create-only PUT of a key
        that exists must be refused); raise a CheckpointError where it does not, unless
        ``allow_unconditional_writes``. Thread-safe; the verdict is cached."""
        with self._probe_lock:
            if self._conditional is None:
                self._conditional = self._probe()
        if not self._conditional and not self.settings.allow_unconditional_writes:
            raise CheckpointError(
                f"the S3 server at {self.endpoint} ignores conditional writes (If-None-Match), "
                "so a commit could overwrite another: use a server that honours them, or set "
                f"{ALLOW_UNCONDITIONAL_ENV}=1 to accept check-then-write, which does not "
                "exclude two racing committers"
            )

    def _probe(self) -> bool:
        key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        body = b"ctj: does this server honour If-None-Match?\n"
        try:
            self._put(key, body, if_absent=True)
        except _NotImplemented:
            return False
        try:
            self._put(key, body, if_absent=True)
            return False
        except ObjectExists:
            return True
        finally:
            try:
                self._delete_batch([key])
            except CheckpointError as exc:
                log.warning("cannot delete the probe %s%s: %s", self.prefix, key, exc)

    def _exists(self, key: str) -> bool:
        try:
            self._retrying(
                "HEAD", key, functools.partial(
                    self._s3.head_object, Bucket=self.bucket, Key=self.prefix + key
                ),
            )  # fmt: skip
        except ObjectNotFound:
            return False
        return True

    # -- the four operations --------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        if if_absent:
            self.check_conditional_writes()
            if not self._conditional:  # opted into the weaker mode
                with self._probe_lock:
                    warn, self._warned_unconditional = not self._warned_unconditional, True
                if warn:
                    log.warning(
                        "the S3 server at %s ignores If-None-Match and %s is set: create-only "
                        "writes check the key first; two racing committers are not excluded",
                        self.endpoint, ALLOW_UNCONDITIONAL_ENV,
                    )  # fmt: skip
                if self._exists(key):
                    raise ObjectExists(key)
        self._put(key, data, if_absent=if_absent)

    def _put(self, key: str, data: bytes | memoryview, *, if_absent: bool) -> None:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        crc = crc32_header(data)
        size = data.nbytes if isinstance(data, memoryview) else len(data)

        def once() -> None:
            body = data if isinstance(data, bytes) else _ViewReader(memoryview(data))
            try:
                self._s3.put_object(
                    Bucket=self.bucket,
                    Key=self.prefix + key,
                    Body=body,
                    ContentLength=size,
                    ChecksumCRC32=crc,
                    **extra,
                )
            finally:
                if isinstance(body, _ViewReader):
                    body.close()

        self._retrying("PUT", key, once)

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        extra = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"} if byte_range else {}

        def once() -> bytes:
            try:
                resp = self._s3.get_object(Bucket=self.bucket, Key=self.prefix + key, **extra)
            except bex.ClientError as exc:
                if byte_range is not None and _range_not_satisfiable(exc):
                    return b""  # the object ends before the range starts (or is empty)
                raise
            body = resp["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
            expected = resp.get("ContentLength")
            if expected is not None and len(data) != expected:
                raise ShortBody(len(data), expected)
            return data

        return self._retrying("GET", key, once)

    def get_into(self, key: str, into: Sequence[memoryview], *, byte_range: tuple[int, int]) -> int:
        """``get`` of ``byte_range`` written into ``into`` as the bytes arrive
        (base.read_into). A response larger than the buffers is not read: its length is
        returned."""
        extra = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"}

        def once() -> int:
            try:
                resp = self._s3.get_object(Bucket=self.bucket, Key=self.prefix + key, **extra)
            except bex.ClientError as exc:
                if _range_not_satisfiable(exc):
                    return 0
                raise
            body = resp["Body"]
            try:
                expected = int(resp["ContentLength"])
                if expected > sum(v.nbytes for v in into):
                    return expected
                got = _read_body_into(body, into, expected)
            finally:
                body.close()
            if got != expected:
                raise ShortBody(got, expected)
            return expected

        return self._retrying("GET", key, once)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        cut = len(self.prefix)
        page_args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        while True:  # page by page, each page retried on its own
            page = self._retrying(
                "LIST", prefix, functools.partial(self._s3.list_objects_v2, **page_args)
            )
            for obj in page.get("Contents", []):
                modified = obj["LastModified"].timestamp()
                yield ObjectInfo(obj["Key"][cut:], int(obj["Size"]), modified)
            if not page.get("IsTruncated"):
                return
            page_args["ContinuationToken"] = page["NextContinuationToken"]

    def delete(self, keys: Iterable[str]) -> None:
        batch: builtins.list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) == 1000:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, keys: Sequence[str]) -> None:
        def once() -> None:
            resp = self._s3.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self.prefix + k} for k in keys], "Quiet": True},
            )
            if resp.get("Errors"):  # per-key failures in a 200 reply: classified by code
                first = resp["Errors"][0]
                raise bex.ClientError(
                    {"Error": {"Code": first.get("Code", ""), "Message": ""}}, "DeleteObjects"
                )

        self._retrying("DELETE", keys[0], once)  # deleting again is harmless


def _range_not_satisfiable(exc: bex.ClientError) -> bool:
    """416 InvalidRange: a ranged GET starting at or past the object's end (S3 answers so
    for any range of an empty object), which ``get`` gives as no bytes."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return exc.response.get("Error", {}).get("Code") == "InvalidRange" or status == 416


def open_store(
    uri: str, s3: S3Settings | None = None, *, create: bool = True
) -> LocalStore | S3Store:
    """The store for a checkpoint URI (the only place that picks a backend). ``create``:
    make a ``file://`` directory that does not exist (a job's first save); without it a
    missing one is an error (the CLI, which inspects what is there)."""

    location = Location.parse(uri)
    if location.scheme == "s3":
        return S3Store(location, s3 or S3Settings.from_env())
    return LocalStore(location.prefix, create=create)
