"""A real S3 server on loopback: SeaweedFS (``weed mini``: master, volume server, filer and
S3 gateway in one process), built from its Go module by hack/cluster-binaries.sh.

moto (local_s3.py) stays the fast default; SeaweedFS is what users may actually run, so
the S3 conformance tests and the benchmarks run against both. Every port is explicit
(gRPC ones included: SeaweedFS would otherwise take ``port + 10000``, which can land in
the ephemeral range) and bound through ``retry_on_bind_conflict``; WebDAV, the admin UI
(its server still runs), the Iceberg and Lance endpoints and telemetry are off (nothing
outside is reachable).
Credentials are the tests' own, in an S3 identity file under the server's directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .binaries import BUILD_SCRIPT, BinariesMissing, built_dirs
from .local_s3 import TEST_CREDENTIALS
from .ports import retry_on_bind_conflict
from .processes import ManagedProcess, wait_until

_PORTS = (
    *("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc"),
    *("s3", "s3.grpc", "admin", "admin.grpc"),  # the admin server (and its worker) always run
)


def find_weed() -> Path:
    """``CTJ_SEAWEEDFS_BIN_DIR``/weed, or where hack/cluster-binaries.sh built it."""
    bin_dir = os.environ.get("CTJ_SEAWEEDFS_BIN_DIR") or built_dirs().get(
        "CTJ_SEAWEEDFS_BIN_DIR", ""
    )
    weed = Path(bin_dir) / "weed"
    if not bin_dir or not os.access(weed, os.X_OK):
        raise BinariesMissing(f"SeaweedFS is not built ({weed}); run {BUILD_SCRIPT}")
    return weed


@dataclass
class SeaweedFS:
    """``start()`` it, use ``endpoint``/``env()``, ``stop()`` it. Data lives in ``root``."""

    root: Path
    weed: Path | None = None
    access_key: str = TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"]
    secret_key: str = TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    process: ManagedProcess | None = field(default=None, init=False)
    ports: dict[str, int] = field(default_factory=dict, init=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": TEST_CREDENTIALS["AWS_REGION"],
        }

    def _identity_file(self) -> Path:
        path = self.root / "s3-identities.json"
        identity = {
            "name": "ctj-tests",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        path.write_text(json.dumps({"identities": [identity]}))
        path.chmod(0o600)
        return path

    def start(self, timeout: float = 120.0) -> SeaweedFS:
        weed = self.weed or find_weed()
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self._identity_file()

        def launch(ports: tuple[int, ...]) -> ManagedProcess:
            named = dict(zip(_PORTS, ports, strict=True))
            argv = [
                str(weed),
                "-logtostderr",  # its log is log_path; glog's files would pile up in /tmp
                "mini",
                f"-dir={data}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                *(f"-{name}.port={port}" for name, port in named.items() if "." not in name),
                *(
                    f"-{name.split('.')[0]}.port.grpc={port}"
                    for name, port in named.items()
                    if name.endswith(".grpc")
                ),
                f"-s3.config={identities}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-webdav=false",
                "-admin.ui=false",
                "-admin.port.legacy=0",
                "-master.telemetry=false",
                "-master.volumeSizeLimitMB=64",
            ]
            return ManagedProcess("seaweedfs", argv, self.log_path, cwd=self.root).start()

        self.process, bound = retry_on_bind_conflict(
            launch, ports=len(_PORTS), what="seaweedfs", timeout=timeout
        )
        self.ports = dict(zip(_PORTS, bound, strict=True))
        self._wait_writable(timeout)
        return self

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=TEST_CREDENTIALS["AWS_REGION"],
        )

    def _wait_writable(self, timeout: float) -> None:
        """The gateway answers before the filer and a volume are ready: wait until an
        object can be written and read back."""
        from botocore.exceptions import BotoCoreError, ClientError

        s3 = self.client()

        def writable() -> bool:
            assert self.process is not None
            self.process.check_alive()
            try:
                try:
                    s3.create_bucket(Bucket="ctj-ready")
                except ClientError as exc:
                    if exc.response["Error"]["Code"] != "BucketAlreadyOwnedByYou":
                        raise
                s3.put_object(Bucket="ctj-ready", Key="probe", Body=b"ok")
                return bool(s3.get_object(Bucket="ctj-ready", Key="probe")["Body"].read() == b"ok")
            except (BotoCoreError, ClientError):
                return False

        wait_until(
            writable,
            timeout=timeout,
            what="SeaweedFS to accept a write",
            interval=0.25,
            on_timeout=lambda: self.process.log_tail() if self.process else "",
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace=10.0)
            self.process = None
