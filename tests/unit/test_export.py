"""``ctj checkpoints export`` never overwrites: a directory with anything in it is refused,
every file is created exclusively, and no name from the checkpoint leaves the directory."""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path

import pytest
import torch

from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.cli import main
from trainer_sidecar.errors import CheckpointError, UnsafeCheckpointError
from trainer_sidecar.format.chunking import hash_chunk
from trainer_sidecar.format.manifest import METADATA_FILE, ChunkRef, FileEntry, manifest_key
from trainer_sidecar.load import export
from trainer_sidecar.load.chunk_reader import ChunkReader
from trainer_sidecar.load.safe_pickle import MetadataUnpickler
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.base import ObjectStore


def saved(tmp_path: Path) -> tuple[str, ObjectStore]:
    uri = f"file://{tmp_path}/ckpt"
    with Checkpointer(CheckpointConfig(uri=uri, keep_last=0)) as ckpt:
        pending = ckpt.save(1, model=torch.nn.Linear(16, 4), extra={"step": 1})
        assert pending is not None
        pending.result()
        return uri, ckpt.store


def test_export_into_a_directory_with_files_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, store = saved(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "__0_0.distcp").write_bytes(b"the user's own")  # a name the checkpoint uses
    with pytest.raises(CheckpointError, match="is not empty") as info:
        export.export_dcp(store, repo.read_manifest(store, 1), out)
    assert str(out) in str(info.value) and "an empty or new directory" in str(info.value)
    assert (out / "__0_0.distcp").read_bytes() == b"the user's own"
    assert sorted(p.name for p in out.iterdir()) == ["__0_0.distcp"]

    assert main(["checkpoints", "export", uri, str(out)]) == 2  # the CLI: one line, no trace
    err = capsys.readouterr().err
    assert err.startswith("ctj: error: ") and err.count("\n") == 1 and "is not empty" in err

    fresh = tmp_path / "fresh"  # a new directory (and an empty one) are fine
    assert main(["checkpoints", "export", uri, str(fresh)]) == 0
    assert (fresh / METADATA_FILE).is_file()


def test_export_creates_every_file_exclusively(tmp_path: Path) -> None:
    """A file that appears meanwhile (a race with the emptiness check) is never truncated."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.distcp").write_bytes(b"keep")
    with pytest.raises(CheckpointError, match="already exists"):
        export._create(out, "x.distcp", [])
    assert (out / "x.distcp").read_bytes() == b"keep"


def test_torch_save_never_replaces_a_file(tmp_path: Path) -> None:
    uri, _ = saved(tmp_path)
    whole = tmp_path / "whole.pt"
    whole.write_bytes(b"keep")
    assert main(["checkpoints", "export", uri, str(tmp_path / "d"), "--torch-save", str(whole)])
    assert whole.read_bytes() == b"keep" and not (tmp_path / "d").exists()
    other = tmp_path / "other.pt"
    assert (
        main(["checkpoints", "export", uri, str(tmp_path / "e"), "--torch-save", str(other)]) == 0
    )
    assert set(torch.load(other, weights_only=True)["model"]) == {"weight", "bias"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def rename_data_file(store: ObjectStore, step: int, new: str) -> None:
    """An attacker's rewrite: the tensors' file renamed in .metadata and in the manifest."""
    manifest = repo.read_manifest(store, step)
    raw = ChunkReader(store, manifest).read_file(METADATA_FILE)
    metadata = MetadataUnpickler(io.BytesIO(raw)).load()
    for index, (name, offset, length) in list(metadata.storage_data.items()):
        if name == "__0_0.distcp":
            metadata.storage_data[index] = (new, offset, length)
    body = pickle.dumps(metadata)
    cid, blocks = hash_chunk(body, manifest.block_size)
    ref = ChunkRef(cid, len(body), len(body), "none", tuple(blocks))
    store.put(ref.key, body)
    entries = dict(manifest.files)
    entries[METADATA_FILE] = FileEntry(len(body), (ref,))
    entries[new] = entries.pop("__0_0.distcp")
    store.put(manifest_key(step), dataclasses.replace(manifest, files=entries).to_bytes())


@pytest.mark.parametrize("target", ["../x", "ABSOLUTE", "a/../../x", ".."])
def test_a_name_leaving_the_directory_is_refused_and_nothing_written(
    tmp_path: Path, target: str
) -> None:
    _, store = saved(tmp_path)
    outside = tmp_path / "outside"
    (outside / "export").mkdir(parents=True)
    name = str(outside / "abs-target") if target == "ABSOLUTE" else target
    rename_data_file(store, 1, name)
    with pytest.raises(UnsafeCheckpointError, match="is not a plain name"):
        export.export_dcp(store, repo.read_manifest(store, 1), outside / "export")
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == [Path("export")]
