"""S3 (and MinIO, SeaweedFS, Ceph RGW, ...) as an object store, through boto3.

Credentials come from boto3's standard chain (environment, shared files, IRSA,
instance metadata); they are never taken from a URI, logged or put in a metric.
Retries are botocore's "standard" mode: only throttling, 5xx and connection
errors are retried, with capped, jittered exponential backoff, then raised.
Every chunk is at most 64 MiB, so each is one PUT; parallelism comes from the
caller uploading many chunks at once (the chunks are the parts).
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
import io
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from ..errors import CheckpointError, ObjectExists, ObjectNotFound
from .base import Location, ObjectInfo
from .local import LocalStore

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "403",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class S3Settings:
    """How to reach the S3 server; credentials are never part of this."""

    endpoint_url: str | None = None
    """e.g. http://minio:9000; None uses AWS (or AWS_ENDPOINT_URL)."""
    region: str | None = None
    """None uses AWS_REGION / AWS_DEFAULT_REGION, then us-east-1."""
    max_attempts: int = 6
    """Attempts per request, first included (botocore standard retry mode)."""
    max_connections: int = 16
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise CheckpointError("s3 max_attempts must be >= 1")
        if self.endpoint_url is not None and "://" not in self.endpoint_url:
            raise CheckpointError(
                f"S3 endpoint {self.endpoint_url!r} has no scheme: use http://host:port"
            )

    @classmethod
    def from_env(cls, **overrides: object) -> S3Settings:
        env: dict[str, object] = {}
        if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
            env["endpoint_url"] = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
                "AWS_ENDPOINT_URL"
            )
        if os.environ.get("CTJ_S3_MAX_ATTEMPTS"):
            env["max_attempts"] = int(os.environ["CTJ_S3_MAX_ATTEMPTS"])
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)  # type: ignore[arg-type]


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
        self.where = f"{location} at {settings.endpoint_url or 'AWS'}"
        self.settings = settings
        config = botocore.config.Config(
            # body integrity by put()'s CRC32 header, not by hashing the body into the signature
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            retries={"max_attempts": settings.max_attempts, "mode": "standard"},
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
        session = boto3.session.Session(
            aws_access_key_id=creds.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=creds.get("AWS_SECRET_ACCESS_KEY"),
        )
        self._s3 = session.client(
            "s3", endpoint_url=settings.endpoint_url, region_name=region, config=config
        )

    # -- errors -------------------------------------------------------------

    def _translate(self, exc: Exception, key: str) -> Exception:
        """Map boto errors to our vocabulary: S3 error codes, never message text."""
        if isinstance(exc, botocore.exceptions.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _NOT_FOUND:
                return ObjectNotFound(key)
            if code in _EXISTS:
                return ObjectExists(key)
            if code == "NoSuchBucket":
                return CheckpointError(
                    f"bucket {self.bucket!r} does not exist at "
                    f"{self.settings.endpoint_url or 'AWS'}: create it or fix the URI"
                )
            if code in _BAD_CREDENTIALS:
                return CheckpointError(
                    f"the S3 server refused our credentials for {self.where} ({code}): "
                    "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the Secret they come from)"
                )
            return CheckpointError(f"S3 error {code} on {key!r} in {self.where}")
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            return CheckpointError(
                "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or an AWS profile / role)"
            )
        if isinstance(
            exc,
            botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectTimeoutError,
        ):
            return CheckpointError(
                f"cannot reach the S3 endpoint {self.settings.endpoint_url or 'AWS'}: "
                "check the endpoint URL (AWS_ENDPOINT_URL or --endpoint-url) and that it is up"
            )
        return exc

    # -- the four operations --------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            body = data if isinstance(data, bytes) else _ViewReader(memoryview(data))
            self._s3.put_object(
                Bucket=self.bucket,
                Key=self.prefix + key,
                Body=body,
                ContentLength=len(data),
                ChecksumCRC32=crc32_header(data),
                **extra,
            )
        except Exception as exc:  # noqa: BLE001 - translated or re-raised as is
            raise self._translate(exc, key) from None

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        extra = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"} if byte_range else {}
        try:
            resp = self._s3.get_object(Bucket=self.bucket, Key=self.prefix + key, **extra)
            data: bytes = resp["Body"].read()
            return data
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, key) from None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self._s3.get_paginator("list_objects_v2")
        cut = len(self.prefix)
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for obj in page.get("Contents", []):
                    yield ObjectInfo(
                        obj["Key"][cut:], int(obj["Size"]), obj["LastModified"].timestamp()
                    )
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, prefix) from None

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
        try:
            self._s3.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self.prefix + k} for k in keys], "Quiet": True},
            )
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, keys[0]) from None


def open_store(uri: str, s3: S3Settings | None = None) -> LocalStore | S3Store:
    """The store for a checkpoint URI (the only place that picks a backend)."""

    location = Location.parse(uri)
    if location.scheme == "s3":
        return S3Store(location, s3 or S3Settings.from_env())
    return LocalStore(location.prefix)
