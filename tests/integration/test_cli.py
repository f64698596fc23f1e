"""The ctj command as a user runs it: export for stock torch, one-line errors for mistakes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ctj_devcluster.local_s3 import LocalS3

from tests.conftest import ROOT, free_port
from tests.integration.ranks import run_ranks
from trainer_sidecar import CheckpointConfig, Checkpointer, CheckpointError

pytestmark = pytest.mark.integration


def ctj(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str | Path = ROOT,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer_sidecar", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=dict(os.environ, **(env or {})),
    )


def test_export_is_read_by_stock_dcp_bitwise(s3_uri: str, tmp_path: Path) -> None:
    args = {
        "kind": "fsdp",
        "uri": s3_uri,
        "step": 3,
        "ref": str(tmp_path / "ref.pt"),
        "export_dir": str(tmp_path / "plain"),
        "torch_save": str(tmp_path / "full.pt"),
    }
    run_ranks(2, "tests.integration.workers:save", args)

    out = ctj("checkpoints", "ls", s3_uri)
    assert out.returncode == 0 and "full" in out.stdout and "3" in out.stdout, out
    out = ctj("checkpoints", "show", s3_uri)
    assert out.returncode == 0 and "format version 3: 2 rank manifests" in out.stdout, out
    assert "__1_0.distcp" in out.stdout and "rank 1  ranks/" in out.stdout, out.stdout
    out = ctj("checkpoints", "verify", s3_uri)
    assert out.returncode == 0 and "step 3: ok" in out.stdout, out
    out = ctj(
        "checkpoints", "export", s3_uri, args["export_dir"], "--torch-save", args["torch_save"]
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "plain" / ".metadata").exists()
    run_ranks(1, "tests.integration.workers:stock_load_of_export", args)


@pytest.fixture
def s3_with_auth() -> Iterator[str]:
    """A second S3 server that checks credentials (moto with IAM auth on)."""
    server = LocalS3.start(extra_env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        yield server.endpoint
    finally:
        server.stop()


def assert_one_line_error(out: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctj: error: "), out.stderr
    assert "Traceback" not in out.stderr
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


def test_a_corrupt_rank_manifest_fails_verify_and_stops_gc(s3_uri: str) -> None:
    import torch

    from trainer_sidecar.store import repository as repo

    with Checkpointer(CheckpointConfig(uri=s3_uri)) as ckpt:
        ckpt.save(1, model=torch.nn.Linear(8, 8)).result()  # type: ignore[union-attr]
        store = ckpt.store
    key = repo.read_manifest(store, 1).ranks[0].key
    store.put(key, store.get(key) + b" ")
    out = ctj("checkpoints", "verify", s3_uri)
    assert out.returncode == 1, out
    assert f"step 1: CORRUPT: rank 0's manifest {key} fails its hash check" in out.stdout, out
    out = ctj("checkpoints", "verify", s3_uri, "--json")
    assert out.returncode == 1, out
    assert json.loads(out.stdout) == [
        {
            "step": 1,
            "status": "corrupt",
            "logical_bytes": repo.read_manifest(store, 1).logical_bytes,
            "problems": [
                {
                    "kind": "corrupt",
                    "what": f"rank 0's manifest {key}",
                    "reason": "fails its hash check",
                }
            ],
        }
    ], out.stdout
    out = ctj("checkpoints", "gc", s3_uri, "--grace", "0")
    assert out.returncode == 2 and "gc stopped, nothing deleted" in out.stderr, out
    assert "ctj checkpoints rm 1" in out.stderr, out.stderr


def test_wrong_scheme() -> None:
    assert_one_line_error(
        ctj("checkpoints", "ls", "gs://bucket/x"),
        "unsupported URI scheme 'gs'",
        "use s3://bucket/prefix",
    )


def test_missing_bucket(s3_env: dict[str, str]) -> None:
    assert_one_line_error(
        ctj("checkpoints", "ls", "s3://no-such-bucket/x"),
        "bucket 'no-such-bucket' does not exist",
        "create it",
    )


def test_wrong_credentials(s3_with_auth: str) -> None:
    env = {
        "AWS_ENDPOINT_URL": s3_with_auth,
        "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG1",
        "AWS_SECRET_ACCESS_KEY": "wrong-secret",
        "AWS_REGION": "us-east-1",
    }
    out = ctj("checkpoints", "ls", "s3://bucket/x", env=env)
    assert_one_line_error(out, "refused our credentials", "AWS_ACCESS_KEY_ID")
    assert "wrong-secret" not in out.stderr and "AKIAWRONG" not in out.stderr


def test_unreachable_endpoint(s3_env: dict[str, str]) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    out = ctj(
        "checkpoints",
        "ls",
        "s3://bucket/x",
        "--endpoint-url",
        closed,
        env={"CTJ_S3_MAX_ATTEMPTS": "2"},
    )
    assert_one_line_error(out, "is unreachable after 2 attempts", closed)


def test_unknown_step(s3_uri: str) -> None:
    assert_one_line_error(
        ctj("checkpoints", "show", s3_uri, "--step", "9"), "no committed checkpoint at step 9"
    )


def test_state_that_does_not_match_the_checkpoint(s3_uri: str) -> None:
    import torch

    config = CheckpointConfig(uri=s3_uri)
    Checkpointer(config).save(1, model=torch.nn.Linear(4, 4)).result()
    with pytest.raises(CheckpointError, match="does not match the state being loaded") as info:
        Checkpointer(config).load(model=torch.nn.Linear(4, 8))
    assert "load it into the same model" in str(info.value)
    with pytest.raises(CheckpointError, match="does not match"):
        Checkpointer(config).load(model=torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_one_unreadable_manifest_among_good_ones(s3_uri: str) -> None:
    """ls, show and verify report an unreadable manifest as such and go on with the rest;
    verify exits 1 when any is bad."""
    import torch

    from trainer_sidecar.format.manifest import manifest_key

    net = torch.nn.Linear(8, 8)
    with Checkpointer(CheckpointConfig(uri=s3_uri, keep_last=0)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, model=net).result()  # type: ignore[union-attr]
        store = ckpt.store
    store.put(manifest_key(2), b"{not json")  # the bucket holds bytes no ctj wrote
    store.put(manifest_key(3), b'{"format": "something-else"}')

    out = ctj("checkpoints", "ls", s3_uri)
    assert out.returncode == 0, (out.stdout, out.stderr)
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert list(rows) == ["1", "2", "3"], out.stdout
    assert "full" in rows["1"] and "unreadable" not in rows["1"], rows
    assert "unreadable: " in rows["2"] and "Expecting property name" in rows["2"], rows
    assert "unreadable: not a ctj checkpoint manifest" in rows["3"], rows
    out = ctj("checkpoints", "ls", s3_uri, "--json")
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert [r["step"] for r in listed] == [1, 2, 3] and listed[0]["mode"] == "full", listed
    assert listed[2] == {"step": 3, "unreadable": "not a ctj checkpoint manifest"}, listed

    out = ctj("checkpoints", "show", s3_uri)  # the newest readable one, the others named
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert out.stdout.startswith("step 1  mode full"), out.stdout
    assert "step 3: unreadable: not a ctj checkpoint manifest" in out.stderr, out.stderr
    assert "step 2: unreadable: " in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = ctj("checkpoints", "show", s3_uri, "--step", "2")
    assert out.returncode == 1 and "Traceback" not in out.stderr, (out.stdout, out.stderr)
    assert out.stdout.startswith("step 2: unreadable: "), out.stdout

    out = ctj("checkpoints", "verify", s3_uri, "--all")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "step 1: ok" in out.stdout and "step 2: unreadable: " in out.stdout, out.stdout
    assert "step 3: unreadable: not a ctj checkpoint manifest" in out.stdout, out.stdout
    out = ctj("checkpoints", "verify", s3_uri, "--all", "--json")
    assert out.returncode == 1, (out.stdout, out.stderr)
    rows = {r["step"]: r for r in json.loads(out.stdout)}
    assert [rows[s]["status"] for s in (1, 2, 3)] == ["ok", "unreadable", "unreadable"], rows
    assert rows[3]["problems"] == [
        {"kind": "unreadable", "what": "manifest", "reason": "not a ctj checkpoint manifest"}
    ], rows
    out = ctj("checkpoints", "verify", s3_uri)  # the latest: unreadable
    assert out.returncode == 1 and "step 3: unreadable: " in out.stdout, out
    out = ctj("checkpoints", "verify", s3_uri, "--step", "1")
    assert out.returncode == 0 and "step 1: ok" in out.stdout, out


# -- the traps a user found (issue 28.6): each a one-line error, exit 2, nothing created --


@pytest.mark.parametrize("uri", ["s3:/bucket/x", "s3:bucket/x", "file:relative/x"])
@pytest.mark.parametrize("command", [["ls"], ["rm", "1"]])
def test_a_malformed_uri_is_refused_and_creates_nothing(
    uri: str, command: list[str], tmp_path: Path
) -> None:
    out = ctj("checkpoints", command[0], uri, *command[1:], cwd=tmp_path)
    assert_one_line_error(out, repr(uri), "use s3://bucket/prefix")
    assert list(tmp_path.iterdir()) == [], "a malformed URI created a path"


@pytest.mark.parametrize(
    "command", [["ls"], ["show"], ["verify"], ["gc"], ["gc", "--dry-run"], ["rm", "1"]]
)
def test_a_missing_directory_is_an_error_and_is_not_created(
    command: list[str], tmp_path: Path
) -> None:
    missing = tmp_path / "no" / "such"
    out = ctj("checkpoints", command[0], f"file://{missing}", *command[1:])
    assert_one_line_error(out, str(missing), "does not exist")
    assert list(tmp_path.iterdir()) == [], "the command created the directory"


@pytest.mark.parametrize(
    ("var", "value", "command", "fix"),
    [
        ("CTJ_S3_MAX_ATTEMPTS", "oops", "ls", "set CTJ_S3_MAX_ATTEMPTS to"),
        ("CTJ_S3_MAX_ATTEMPTS", "0", "ls", "1 or more"),
        ("CTJ_S3_ALLOW_UNCONDITIONAL_WRITES", "maybe", "ls", "use 1 or 0"),
        ("AWS_ENDPOINT_URL", "minio:9000", "ls", "use http(s)://host[:port]"),
        ("AWS_ENDPOINT_URL", "http://minio:port", "ls", "use http(s)://host[:port]"),
        ("AWS_ENDPOINT_URL", "http://key:s3cret@", "ls", "use http(s)://host[:port]"),
        ("AWS_REGION", "us east 1", "ls", "one like us-east-1"),
        ("AWS_PROFILE", "no-such-profile", "ls", "fix AWS_PROFILE, or unset it"),
        ("CTJ_TRUST_PICKLED_VALUES", "oops", "verify", "use 1 or 0"),
    ],
)
def test_a_bad_environment_setting_is_one_line_naming_it(
    var: str, value: str, command: str, fix: str, s3_uri: str
) -> None:
    out = ctj("checkpoints", command, s3_uri, env={var: value})
    assert_one_line_error(out, var, fix)
    assert "s3cret" not in out.stderr, out.stderr


@pytest.fixture
def closed_endpoint() -> Iterator[str]:
    """A loopback port bound and not listening: every connect is refused at once (and no
    other process can take the port meanwhile)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def blackholed_endpoint() -> Iterator[str]:
    """A loopback port whose connects hang, as to an address that drops every packet: a
    listener with a backlog of 0 whose one queued connection is never accepted, so the
    kernel drops every further SYN."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        with socket.socket() as check:  # the queue is full: a connect now times out
            check.settimeout(0.5)
            with pytest.raises(TimeoutError):
                check.connect(listener.getsockname())
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["closed", "blackholed"])
def test_an_unreachable_endpoint_is_reported_within_seconds(
    kind: str, request: pytest.FixtureRequest, s3_env: dict[str, str]
) -> None:
    """With the default retries (the sidecar's, six attempts) the CLI's first contact
    still gives up within seconds, saying what it tried and how long it took. The bound is
    on that time, the error's own: the command's wall time adds the interpreter's start
    and imports, which the test tiers beside this one can stretch past any bound (10.4 s
    once, under three lanes); the subprocess's timeout bounds the whole."""
    endpoint = request.getfixturevalue(f"{kind}_endpoint")
    out = ctj(
        "checkpoints", "ls", "s3://some-bucket/jobs/x", env={"AWS_ENDPOINT_URL": endpoint},
        timeout=30,
    )  # fmt: skip
    assert_one_line_error(out, endpoint, "bucket 'some-bucket'", "AWS_ENDPOINT_URL")
    spent = re.search(r"([0-9.]+) s in all", out.stderr)
    assert spent, out.stderr
    assert float(spent[1]) < 10, f"{kind}: gave up after {spent[1]} s"


def test_json_on_every_command(s3_uri: str, tmp_path: Path) -> None:
    """--json: one JSON document on stdout with the keys README documents; on a mistake,
    nothing on stdout and the one-line error on stderr."""
    import torch

    with Checkpointer(CheckpointConfig(uri=s3_uri, keep_last=0)) as ckpt:
        for step in (1, 2):
            ckpt.save(step, model=torch.nn.Linear(8, 8)).result()  # type: ignore[union-attr]

    def run(*args: str, rc: int = 0) -> object:
        out = ctj("checkpoints", *args, "--json")
        assert out.returncode == rc, (args, out.stdout, out.stderr)
        return json.loads(out.stdout)

    listed = run("ls", s3_uri)
    assert [r["step"] for r in listed] == [1, 2], listed  # type: ignore[union-attr]
    assert set(listed[0]) == {  # type: ignore[index]
        "step", "mode", "base_step", "world_size", "logical_bytes", "uploaded_bytes", "created"
    }  # fmt: skip
    assert run("show", s3_uri, "--step", "1")["step"] == 1  # type: ignore[index]
    verified = run("verify", s3_uri, "--all")
    assert [(r["step"], r["status"], r["problems"]) for r in verified] == [  # type: ignore[union-attr]
        (1, "ok", []),
        (2, "ok", []),
    ], verified
    assert verified[0]["logical_bytes"] > 0, verified  # type: ignore[index]
    assert run("rm", s3_uri, "1") == {"removed": [1]}
    for dry_run in (True, False):
        report = run("gc", s3_uri, "--grace", "0", *(["--dry-run"] if dry_run else []))
        assert report == {
            "dry_run": dry_run,
            "deleted_chunks": report["deleted_chunks"],  # type: ignore[index]
            "deleted_bytes": report["deleted_bytes"],  # type: ignore[index]
            "deleted_parts": 0,
            "deleted_rank_manifests": 1,
            "kept_chunks": report["kept_chunks"],  # type: ignore[index]
        }, report
    exported = run("export", s3_uri, str(tmp_path / "plain"))
    assert exported == {"step": 2, "out_dir": str(tmp_path / "plain"), "torch_save": None}

    out = ctj("checkpoints", "verify", "s3://no-such-bucket/x", "--json")
    assert_one_line_error(out, "bucket 'no-such-bucket' does not exist")
    assert out.stdout == "", out.stdout
