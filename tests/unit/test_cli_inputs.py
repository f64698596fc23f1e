"""What the ctj command takes from its user, checked before anything is touched: the URI
(parsed strictly), every environment setting (a one-line error naming the variable and the
fix), and the bounded first contact with S3; and the shapes of ``--json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_sidecar import CheckpointConfig, CheckpointError
from trainer_sidecar.cli import Problem, main, verdict
from trainer_sidecar.store.base import Location, uri_problem
from trainer_sidecar.store.s3 import S3Settings, endpoint_problem, first_contact, region_problem


@pytest.mark.parametrize(
    ("uri", "want"),
    [
        ("s3://bucket/a/b/", Location("s3", "bucket", "a/b")),
        ("s3://Legacy_Bucket.1/x", Location("s3", "Legacy_Bucket.1", "x")),
        ("file:///tmp/x/", Location("file", "", "/tmp/x")),
        ("file://localhost/tmp/x", Location("file", "", "/tmp/x")),
        ("relative/dir", Location("file", "", "relative/dir")),
        ("./s3:x", Location("file", "", "./s3:x")),  # a relative path may hold a colon
    ],
)
def test_a_well_formed_uri_parses(uri: str, want: Location) -> None:
    assert uri_problem(uri) is None
    assert Location.parse(uri) == want


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("s3:/bucket/x", "has a scheme without '://'"),
        ("s3:bucket/x", "has a scheme without '://'"),
        ("file:relative/x", "has a scheme without '://'"),
        ("s3://bucket/x ", "has leading or trailing spaces"),
        ("s3://bucket/x?versionId=1", "has a query or fragment"),
        ("s3://bucket/a#b", "has a query or fragment"),
        ("s3://bucket:9000/x", "has a bucket name with characters no bucket has"),
        ("s3://bucket/a//b", "has an empty, '.' or '..' segment"),
        ("s3://bucket/a/../b", "has an empty, '.' or '..' segment"),
        ("s3:///x", "names no bucket"),
        ("s3://[bucket/x", "does not parse as a URI"),
        ("file://host/x", "has a host"),
        ("gs://bucket/x", "has an unsupported URI scheme 'gs'"),
        ("", "is empty"),
    ],
)
def test_a_malformed_uri_is_one_line_naming_it_and_the_fix(uri: str, problem: str) -> None:
    assert (uri_problem(uri) or "").startswith(problem)
    with pytest.raises(CheckpointError) as info:
        Location.parse(uri)
    message = str(info.value)
    assert "\n" not in message and problem in message and (repr(uri) in message or not uri)
    assert "use " in message or "remove them" in message


def test_credentials_in_a_uri_are_refused_and_never_repeated() -> None:
    with pytest.raises(CheckpointError, match="never put them in a URI") as info:
        Location.parse("s3://AKIAEXAMPLE:s3cret@bucket/x")
    assert "s3cret" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://minio:9000", None),
        ("https://s3.us-east-1.amazonaws.com", None),
        ("http://[::1]:9000", None),
        ("http://user:pw@minio:9000", None),  # accepted, and redacted wherever it is named
        ("minio:9000", "has no scheme"),
        ("ftp://minio:9000", "has the scheme 'ftp', not http or https"),
        ("http://minio:port", "has a port that is not a number"),
        ("http://minio:70000", "has a port that is not a number"),
        ("http://", "names no host"),
        ("http://a b:9000", "is not a valid URL"),
        ("http://[::1:9000", "is not a valid URL"),
    ],
)
def test_endpoint_problem(url: str, problem: str | None) -> None:
    got = endpoint_problem(url)
    assert got is None if problem is None else (got or "").startswith(problem), got


@pytest.mark.parametrize(
    ("region", "ok"), [("us-east-1", True), ("garage", True), ("us east", False), ("-x", False)]
)
def test_region_problem(region: str, ok: bool) -> None:
    assert (region_problem(region) is None) is ok


@pytest.mark.parametrize(
    ("var", "value", "phrases"),
    [
        ("CTJ_S3_MAX_ATTEMPTS", "oops", ["CTJ_S3_MAX_ATTEMPTS='oops' is not a whole number"]),
        ("CTJ_S3_MAX_ATTEMPTS", "-1", ["CTJ_S3_MAX_ATTEMPTS='-1' is less than 1", "1 or more"]),
        ("CTJ_S3_ALLOW_UNCONDITIONAL_WRITES", "maybe", ["is not a boolean: use 1 or 0"]),
        ("AWS_ENDPOINT_URL", "minio:9000", ["AWS_ENDPOINT_URL='minio:9000' has no scheme"]),
        ("AWS_ENDPOINT_URL_S3", "http://h:x", ["AWS_ENDPOINT_URL_S3='http://h:x' has a port"]),
        ("AWS_ENDPOINT_URL", "http://k:s3cret@", ["AWS_ENDPOINT_URL='http://' names no host"]),
        ("AWS_ENDPOINT_URL", "http://k:s3cret@[::1", ["AWS_ENDPOINT_URL='http://[::1'"]),
        ("AWS_REGION", "us east", ["AWS_REGION='us east' is not a region name"]),
        ("AWS_DEFAULT_REGION", "us east", ["AWS_DEFAULT_REGION='us east'"]),
    ],
)
def test_a_bad_s3_setting_names_its_variable_and_the_fix(
    var: str, value: str, phrases: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(var, value)
    with pytest.raises(CheckpointError) as info:
        S3Settings.from_env()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{var}="), message
    assert all(p in message for p in phrases), message
    assert "s3cret" not in message


def test_s3_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:9000")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:9000")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("CTJ_S3_MAX_ATTEMPTS", "3")
    got = S3Settings.from_env()
    assert (got.endpoint_url, got.region, got.max_attempts) == (
        "http://s3-only:9000",
        "eu-west-1",
        3,
    )
    assert S3Settings.from_env(endpoint_url="http://flag:1").endpoint_url == "http://flag:1"


def test_first_contact_is_bounded_and_the_daemons_keep_their_patience() -> None:
    patient = S3Settings()  # what the trainer and the sidecar use
    assert (patient.max_attempts, patient.connect_timeout_s, patient.backoff_cap_s) == (6, 5, 20)
    quick = first_contact(patient)
    worst_s = quick.max_attempts * quick.connect_timeout_s + quick.backoff_cap_s
    assert quick.max_attempts == 2 and worst_s <= 5, quick
    stricter = first_contact(S3Settings(max_attempts=1, connect_timeout_s=0.5))
    assert (stricter.max_attempts, stricter.connect_timeout_s) == (1, 0.5)


@pytest.mark.parametrize(
    ("env", "phrases"),
    [
        ({"CTJ_CHECKPOINT_KEEP_LAST": "x"}, ["CTJ_CHECKPOINT_KEEP_LAST='x'", "a whole number"]),
        ({"CTJ_CHECKPOINT_KEEP_LAST": "-1"}, ["CTJ_CHECKPOINT_KEEP_LAST: ", "keep_last is -1"]),
        ({"CTJ_CHECKPOINT_MODE": "often"}, ["CTJ_CHECKPOINT_MODE: ", "use one of full"]),
        ({"CTJ_SIDECAR": "perhaps"}, ["CTJ_SIDECAR='perhaps'", "set it to 1 or 0"]),
        ({"CTJ_SHUTDOWN_GRACE_S": "soon"}, ["CTJ_SHUTDOWN_GRACE_S='soon'", "a number"]),
        ({"CTJ_CHECKPOINT_URI": "s3:/b/x"}, ["CTJ_CHECKPOINT_URI: ", "without '://'"]),
        (
            {"CTJ_CACHE_PORT": "9500", "CTJ_CACHE_TOKEN": "short-s3cret"},
            ["CTJ_CACHE_TOKEN: ", "16+ characters"],
        ),
    ],
)
def test_a_bad_checkpoint_setting_names_its_variable(
    env: dict[str, str], phrases: list[str]
) -> None:
    with pytest.raises(CheckpointError) as info:
        CheckpointConfig.from_env({"CTJ_CHECKPOINT_URI": "s3://b/p", **env})
    message = str(info.value)
    assert "\n" not in message and all(p in message for p in phrases), message
    assert "s3cret" not in message


def test_an_override_is_not_blamed_on_the_environment() -> None:
    with pytest.raises(CheckpointError) as info:
        CheckpointConfig.from_env({"CTJ_CHECKPOINT_URI": "s3://b/p"}, keep_last=-1)
    assert str(info.value).startswith("checkpoint config: keep_last is -1")


def corrupt(what: str) -> Problem:
    return Problem("corrupt", what, "fails its hash check", f"CORRUPT: {what}")


@pytest.mark.parametrize(
    ("problems", "status"),
    [
        ([], "ok"),
        ([corrupt("c1")], "corrupt"),
        ([corrupt("c1"), Problem("unsafe", "c2", "pickle", "UNSAFE: c2 pickle")], "unsafe"),
        ([Problem("unreadable", "manifest", "bad json", "unreadable: bad json")], "unreadable"),
    ],
)
def test_verify_verdict_is_the_worst_problem(problems: list[Problem], status: str) -> None:
    found = verdict(7, 10, problems)
    assert found.status == status
    assert found.to_json()["problems"] == [
        {"kind": p.kind, "what": p.what, "reason": p.reason} for p in problems
    ]


COMMANDS = [["ls"], ["show"], ["verify"], ["gc"], ["gc", "--dry-run"], ["rm", "1"], ["export"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_no_command_creates_a_missing_directory(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "gone"
    extra = [str(tmp_path / "out")] if command == ["export"] else []
    assert main(["checkpoints", command[0], f"file://{missing}", *command[1:], *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"ctj: error: checkpoint directory {missing} does not exist: check the URI " \
        "(a job creates its directory at its first save)\n"  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_json_of_an_empty_location(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"file://{tmp_path}"

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(["checkpoints", args[0], uri, *args[1:], "--json"])
        out, err = capsys.readouterr()
        return rc, out, err

    assert run("ls") == (0, "[]\n", "")
    rc, out, _ = run("gc", "--dry-run")
    assert rc == 0 and json.loads(out) == {
        "dry_run": True,
        "deleted_chunks": 0,
        "deleted_bytes": 0,
        "deleted_parts": 0,
        "kept_chunks": 0,
        "deleted_rank_manifests": 0,
    }
    # a mistake: nothing on stdout, the one-line error on stderr
    assert run("verify") == (2, "", "ctj: error: no committed checkpoint at this location\n")
    assert run("rm", "3") == (2, "", "ctj: error: no committed checkpoint at step(s) [3]\n")
