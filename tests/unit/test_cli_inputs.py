"""What the ctj command takes from its user, checked before anything is touched: the URI
(parsed strictly), every environment setting (a one-line error naming the variable and the
fix), and the bounded first contact with S3; and the shapes of ``--json``."""

from __future__ import annotations

import pytest

from trainer_sidecar import CheckpointError
from trainer_sidecar.store.base import Location, uri_problem


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
