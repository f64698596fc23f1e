"""Safe loading against a real S3 server: a bucket writer cannot run code in the trainer.

Each hostile checkpoint is made the way an attacker with write access would make
one: real stored objects rewritten, the new bytes stored as a new chunk
(content-addressed) and the step's manifest replaced by one naming it. The
payload's ``__reduce__`` would create a marker file; nothing that reads the
checkpoint (load, ``show``, ``verify``, ``export``) may ever create it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_sidecar import CheckpointConfig, Checkpointer, CheckpointError, PendingSave
from trainer_sidecar.cli import main as cli_main
from trainer_sidecar.format.chunking import hash_chunk
from trainer_sidecar.format.manifest import (
    METADATA_FILE,
    ChunkRef,
    FileEntry,
    Manifest,
    Mode,
    manifest_key,
)
from trainer_sidecar.load.chunk_reader import ChunkReader
from trainer_sidecar.load.safe_pickle import MetadataUnpickler
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.base import ObjectStore

pytestmark = pytest.mark.integration


class Touch:
    """Unpickling it runs ``touch <path>``: what a hostile pickle in the bucket does."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.path}",)


@dataclasses.dataclass
class Custom:
    """A legitimate value weights_only refuses: a class of the user's own."""

    n: int


@dataclasses.dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


Ctj = Callable[..., Ran]


@pytest.fixture
def ctj(capsys: pytest.CaptureFixture[str]) -> Ctj:
    """``ctj ARGS`` run in this process (cli.main: what ``python -m trainer_sidecar`` runs),
    not in a new one: the command's code is the same, without a torch import per call
    (~5 s each here). An exception the CLI does not turn into its one-line error fails
    the test, as a traceback on stderr would."""

    def run(*args: str) -> Ran:
        capsys.readouterr()
        rc = cli_main(list(args))
        out, err = capsys.readouterr()
        return Ran(rc, out, err)

    return run


def model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def committed(pending: PendingSave | None) -> None:
    assert pending is not None, "the save was skipped"
    pending.result()


def read_file(store: ObjectStore, step: int, name: str) -> bytes:
    return ChunkReader(store, repo.read_manifest(store, step)).read_file(name)


def replace_files(store: ObjectStore, step: int, files: dict[str, bytes]) -> None:
    """Rewrite a committed step as an attacker would: each new file body stored as a new
    chunk at its content address, and the manifest replaced by one naming them."""
    manifest = repo.read_manifest(store, step)
    entries = dict(manifest.files)
    for name, body in files.items():
        cid, blocks = hash_chunk(body, manifest.block_size)
        ref = ChunkRef(cid, len(body), len(body), "none", tuple(blocks))
        store.put(ref.key, body)
        entries[name] = FileEntry(len(body), (ref,))
    rewritten = dataclasses.replace(manifest, files=entries)
    store.put(manifest_key(step), rewritten.to_bytes())


def real_metadata(store: ObjectStore, step: int) -> Any:
    """The step's metadata (ours, so plain pickle would do; the allow-list is enough)."""
    import io

    return MetadataUnpickler(io.BytesIO(read_file(store, step, METADATA_FILE))).load()


def plant_in_metadata(store: ObjectStore, step: int, marker: Path) -> None:
    metadata = real_metadata(store, step)
    metadata.planner_data = {"extra.step": Touch(marker)}
    replace_files(store, step, {METADATA_FILE: pickle.dumps(metadata)})


def plant_in_value(store: ObjectStore, step: int, marker: Path, fqn: str = "extra.pos") -> None:
    """Append a hostile value to the values file and point ``fqn`` at it."""
    import io

    metadata = real_metadata(store, step)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    name, _, _ = metadata.storage_data[index]
    body = read_file(store, step, name)
    buf = io.BytesIO()
    torch.save(Touch(marker), buf)
    metadata.storage_data[index] = (name, len(body), len(buf.getvalue()))
    replace_files(store, step, {name: body + buf.getvalue(), METADATA_FILE: pickle.dumps(metadata)})


PLANTERS = {"metadata": plant_in_metadata, "value": plant_in_value}


def saved_extra(step: int) -> dict[str, Any]:
    """The values saved with ``step``: their size changes from step to step (as a data
    loader's position would), so no two steps share a metadata or values chunk."""
    return {"step": step, "pos": [step, 7], "note": "x" * 100 * step}


def blank_extra() -> dict[str, Any]:
    return {"step": -1, "pos": [-1, -1], "note": ""}


def save_steps(config: CheckpointConfig, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Commit each step (parameters changed between them); the state each one saved."""
    net = model(0)
    saved = {}
    with Checkpointer(config) as ckpt:
        for step in steps:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
            committed(ckpt.save(step, model=net, extra=saved_extra(step)))
            saved[step] = {k: v.clone() for k, v in net.state_dict().items()}
    return saved


def restore_failures(ckpt: Checkpointer) -> float:
    value = ckpt.metrics.registry.get_sample_value(
        "ctj_checkpoint_failures_total", {"stage": "restore"}
    )
    return value or 0.0


@pytest.mark.parametrize("where", ["metadata", "value"])
def test_a_hostile_checkpoint_is_never_run_and_load_falls_back(
    where: str, s3_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, ctj: Ctj
) -> None:
    config = CheckpointConfig(uri=s3_uri, mode=Mode.FULL)
    saved = save_steps(config, [1, 2])
    marker = tmp_path / "ran"
    store = Checkpointer(config).store
    PLANTERS[where](store, 2, marker)

    fresh, extra = model(5), blank_extra()
    ckpt = Checkpointer(config)
    with caplog.at_level(logging.WARNING, logger="ctj.checkpoint"):
        loaded = ckpt.load(model=fresh, extra=extra)
    assert not marker.exists()
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (2,)
    assert extra == saved_extra(1)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved[1].items())
    warning = next(
        r.message
        for r in caplog.records
        if r.name == "ctj.checkpoint" and "step 2 is unusable" in r.message
    )
    assert "refused, never run" in warning and "loading step 1 instead" in warning
    assert "posix.system" in warning
    if where == "value":
        assert "value 'extra.pos' is refused by torch.load(weights_only=True)" in warning
    assert restore_failures(ckpt) == 1

    out = ctj("checkpoints", "show", s3_uri, "--step", "2")
    assert out.returncode == 0 and "step 2" in out.stdout, out.stderr
    out = ctj("checkpoints", "verify", s3_uri, "--all")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "step 1: ok" in out.stdout and "step 2: UNSAFE" in out.stdout, out.stdout
    export_dir, whole = tmp_path / "plain", tmp_path / "whole.pt"
    out = ctj(
        "checkpoints", "export", s3_uri, str(export_dir), "--step", "2", "--torch-save", str(whole)
    )
    assert out.returncode == 2 and "step 2 is unusable" in out.stderr, (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (export_dir / METADATA_FILE).exists() and not whole.exists()
    assert not marker.exists()


@pytest.mark.parametrize("where", ["metadata", "value"])
def test_with_only_a_hostile_checkpoint_load_says_so(
    where: str, s3_uri: str, tmp_path: Path
) -> None:
    config = CheckpointConfig(uri=s3_uri)
    save_steps(config, [1])
    marker = tmp_path / "ran"
    PLANTERS[where](Checkpointer(config).store, 1, marker)
    with pytest.raises(CheckpointError, match="no usable checkpoint") as info:
        Checkpointer(config).load(model=model(5), extra=blank_extra())
    assert "step 1 is unusable" in str(info.value) and "refused, never run" in str(info.value)
    assert not marker.exists()


def test_trusting_pickled_values_loads_a_custom_class(
    s3_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CheckpointConfig(uri=s3_uri)
    with Checkpointer(config) as ckpt:
        committed(ckpt.save(1, model=model(0), extra={"obj": Custom(3)}))

    with pytest.raises(CheckpointError) as info:
        Checkpointer(config).load(model=model(5), extra={"obj": None})
    message = str(info.value)
    assert "'extra.obj'" in message and "weights_only" in message, message
    assert "CTJ_TRUST_PICKLED_VALUES=1" in message

    extra: dict[str, Any] = {"obj": None}
    trusted = dataclasses.replace(config, trust_pickled_values=True)
    loaded = Checkpointer(trusted).load(model=model(5), extra=extra)
    assert loaded is not None and loaded.step == 1 and extra == {"obj": Custom(3)}

    monkeypatch.setenv("CTJ_TRUST_PICKLED_VALUES", "1")
    from_env = CheckpointConfig.from_env(uri=s3_uri)
    assert from_env.trust_pickled_values
    extra = {"obj": None}
    assert Checkpointer(from_env).load(model=model(5), extra=extra) is not None
    assert extra == {"obj": Custom(3)}


def rename_data_file(store: ObjectStore, step: int, new: str, *, in_manifest: bool) -> str:
    """Point the tensors at file ``new``: in the metadata, and in the manifest too if
    ``in_manifest`` (else the metadata names a file the manifest does not have)."""
    metadata = real_metadata(store, step)
    old = "__0_0.distcp"
    for index, (name, offset, length) in list(metadata.storage_data.items()):
        if name == old:
            metadata.storage_data[index] = (new, offset, length)
    files = {METADATA_FILE: pickle.dumps(metadata)}
    replace_files(store, step, files)
    if in_manifest:
        manifest = repo.read_manifest(store, step)
        entries = dict(manifest.files)
        entries[new] = entries.pop(old)
        store.put(manifest_key(step), dataclasses.replace(manifest, files=entries).to_bytes())
    return old


@pytest.mark.parametrize("in_manifest", [True, False], ids=["manifest", "metadata"])
@pytest.mark.parametrize("target", ["../evil", "ABSOLUTE", "sub/evil", "evil\0x"])
def test_export_refuses_names_outside_its_directory(
    target: str, in_manifest: bool, s3_uri: str, tmp_path: Path, ctj: Ctj
) -> None:
    config = CheckpointConfig(uri=s3_uri)
    save_steps(config, [1])
    outside = tmp_path / "outside"
    outside.mkdir()
    export_dir = outside / "export"
    name = str(outside / "abs-target") if target == "ABSOLUTE" else target
    rename_data_file(Checkpointer(config).store, 1, name, in_manifest=in_manifest)
    Manifest.from_bytes(Checkpointer(config).store.get(manifest_key(1)))  # still parses

    out = ctj("checkpoints", "export", s3_uri, str(export_dir))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "step 1 is unusable" in out.stderr and "Traceback" not in out.stderr, out.stderr
    everything = sorted(p.relative_to(outside) for p in outside.rglob("*"))
    assert everything in ([], [Path("export")]), everything
