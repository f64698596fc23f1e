from __future__ import annotations

import os

import pytest

from trainer_sidecar import CheckpointConfig, CheckpointError
from trainer_sidecar.format.manifest import ChunkRef, FileEntry, Manifest
from trainer_sidecar.store.base import Location


@pytest.mark.parametrize(
    ("uri", "want"),
    [
        ("s3://bucket/a/b/", Location("s3", "bucket", "a/b")),
        ("s3://bucket", Location("s3", "bucket", "")),
        ("file:///tmp/x/", Location("file", "", "/tmp/x")),
        ("/tmp/y", Location("file", "", "/tmp/y")),
    ],
)
def test_location_parse(uri: str, want: Location) -> None:
    assert Location.parse(uri) == want


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("gs://bucket/x", "unsupported URI scheme 'gs'"),
        ("s3:///x", "names no bucket"),
        ("", "empty"),
    ],
)
def test_bad_uri_names_problem_and_fix(uri: str, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as info:
        Location.parse(uri)
    assert "use " in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mode", "sometimes", "mode is 'sometimes': use one of full, incremental, differential"),
        ("full_every", 0, "full_every is 0"),
        ("chunk_size", 1000, "chunk_size must be a multiple"),
        ("compression", "lz4", "compression is 'lz4'"),
    ],
)
def test_config_validation_names_field(field: str, value: object, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        CheckpointConfig(uri="file:///tmp/x", **{field: value})  # type: ignore[arg-type]


def test_config_from_env() -> None:
    cfg = CheckpointConfig.from_env(
        {
            "CTJ_CHECKPOINT_URI": "s3://b/p",
            "CTJ_CHECKPOINT_MODE": "differential",
            "CTJ_CHECKPOINT_FULL_EVERY": "4",
        }
    )
    assert (cfg.uri, cfg.mode, cfg.full_every) == ("s3://b/p", "differential", 4)
    with pytest.raises(CheckpointError, match="CTJ_CHECKPOINT_URI"):
        CheckpointConfig.from_env({})
    with pytest.raises(CheckpointError, match="CTJ_CHECKPOINT_KEEP_LAST='x'"):
        CheckpointConfig.from_env(
            {"CTJ_CHECKPOINT_URI": "s3://b/p", "CTJ_CHECKPOINT_KEEP_LAST": "x"}
        )


def test_staging_dir_defaults_to_ctj_staging_dir_then_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CTJ_STAGING_DIR", "/mnt/fast/ctj")
    assert CheckpointConfig(uri="s3://b/p").staging_dir == "/mnt/fast/ctj"
    monkeypatch.delenv("CTJ_STAGING_DIR")
    assert CheckpointConfig(uri="s3://b/p").staging_dir.endswith(f"/ctj-staging-{os.getuid()}")


def test_manifest_round_trip() -> None:
    chunk = ChunkRef("ab" * 32, 10, 8, "zstd", ("cd" * 32,))
    m = Manifest(
        step=7,
        mode="incremental",
        parent_step=6,
        base_step=5,
        since_full=2,
        world_size=4,
        block_size=1 << 20,
        files={"__0_0.distcp": FileEntry(10, (chunk,))},
        logical_bytes=10,
        uploaded_bytes=8,
        deduplicated_bytes=2,
        created=1.5,
        timings={"stage": 0.1},
        versions={"ctj": "0.1.0"},
    )
    assert Manifest.from_bytes(m.to_bytes()) == m
    assert chunk.key == f"chunks/ab/{'ab' * 32}.zst"
