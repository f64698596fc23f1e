"""Fixtures shared by every test tier: real S3 servers on loopback (moto; SeaweedFS), fresh
buckets."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import tracemalloc
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator

import pytest
from ctj_devcluster.binaries import BinariesMissing
from ctj_devcluster.local_s3 import LocalS3, wait_for_port
from ctj_devcluster.ports import free_port, retry_on_bind_conflict
from ctj_devcluster.seaweedfs import SeaweedFS, find_weed

from trainer_sidecar.config import default_staging_root

# Where the test command's time goes, tier by tier (tests/<tier>/...), printed at the end
# of every run: setup, call and teardown of every test, so fixtures count where they run.
_tier_seconds: defaultdict[str, float] = defaultdict(float)
_tier_tests: Counter[str] = Counter()
_file_seconds: defaultdict[str, float] = defaultdict(float)
SLOWEST_FILES = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    parts = report.nodeid.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    _tier_seconds[tier] += report.duration
    _tier_tests[tier] += report.when == "call"
    _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _tier_seconds:
        return
    terminalreporter.section("time per tier")
    for tier, seconds in sorted(_tier_seconds.items(), key=lambda kv: -kv[1]):
        minutes, rest = divmod(round(seconds), 60)
        terminalreporter.write_line(
            f"{tier:<12} {minutes:3d} min {rest:02d} s  ({_tier_tests[tier]} tests)"
        )
    # the files, with their module fixtures (a cluster started per module counts here)
    terminalreporter.section(f"slowest {SLOWEST_FILES} test files")
    slowest = sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")


# the scenario both cluster tiers run asserts what ctj promises: pytest explains those
# asserts as it does a test's own (registered before any test module imports it)
pytest.register_assert_rewrite("ctj_stack.scenario")

__all__ = ["ROOT", "free_port", "retry_on_bind_conflict", "wait_for_port"]
"""Ports: ``free_port()`` is a port free a moment ago (fine for "nothing listens here");
to start a server on one, ``retry_on_bind_conflict(launch, ports=n, log=...)`` restarts
it on new ports if another process binds the chosen one first (see ctj_devcluster.ports)."""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def promtool_check(exposition: str) -> subprocess.CompletedProcess[str]:
    """Prometheus's own checker over a /metrics body (hack/system-tools.sh installs it)."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: run hack/system-tools.sh (or ./hack/test.sh)")
    return subprocess.run(
        ["promtool", "check", "metrics"], input=exposition, text=True, capture_output=True
    )


@pytest.fixture(scope="session", autouse=True)
def _private_staging_root() -> Iterator[None]:
    """Staging buffers live in /dev/shm: this session's jobs (and the rank and sidecar
    processes they start, through CTJ_STAGING_DIR) stage under a root of their own,
    removed at the end; other processes' staged checkpoints are never touched."""
    parent = os.path.dirname(default_staging_root())
    root = tempfile.mkdtemp(prefix="ctj-test-staging-", dir=parent)
    before = os.environ.get("CTJ_STAGING_DIR")
    os.environ["CTJ_STAGING_DIR"] = root
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CTJ_STAGING_DIR", None)
        else:
            os.environ["CTJ_STAGING_DIR"] = before
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 server (moto's server mode) on loopback, for the whole session."""
    server = LocalS3.start()
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A real SeaweedFS (``weed mini``, built by hack/cluster-binaries.sh) on loopback, for
    the whole session; skipped, saying why, where it is not built."""
    try:
        weed = find_weed()
    except BinariesMissing as exc:
        pytest.skip(str(exc))
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), weed).start()
    try:
        yield server
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


@contextlib.contextmanager
def traced_peak() -> Iterator[list[int]]:
    """The peak of traced memory (Python objects, numpy, the C unpickler's memo) while the
    block runs, in the list it yields: what a hostile object's claim costs a reader."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
