"""Safe loading: what a bucket writer puts in a checkpoint is refused before it can run.

The allow-list must accept the metadata real DCP saves of the installed torch write
(plain, DDP-style and FSDP2/DTensor models with AdamW state) and refuse any other
global without resolving it; values go through weights_only; failures that cross
ranks survive a pickle; a load failure is told apart by what it really is.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import subprocess
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.integration.workers import Net
from trainer_sidecar.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StoreUnavailable,
    UnsafeCheckpointError,
)
from trainer_sidecar.load.checks import check_file_name, check_metadata, storage_location
from trainer_sidecar.load.planner import StateMismatch, decode_value
from trainer_sidecar.load.restore import find_corruption, real_error
from trainer_sidecar.load.safe_pickle import ALLOWED_CLASSES, MetadataUnpickler, load_metadata


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A 1-rank gloo group in this process: enough for FSDP2 to shard into DTensors."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    net = Net()
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for layer in (net.fc1, net.fc2):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    elif kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(net)
    return net


def saved_metadata(kind: str, where: Path) -> bytes:
    """The .metadata stock DCP (FileSystemWriter) writes for a model and its AdamW state."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, [opt])
    extra = {"step": 3, "rng": torch.get_rng_state(), "pos": [1, 2], "name": "run"}
    dcp.save({"model": model_sd, "optim": optim_sd, "extra": extra}, checkpoint_id=where)
    return (where / ".metadata").read_bytes()


class Recording(pickle.Unpickler):
    """Full pickle, noting every global it resolves (only ever run on our own saves)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.globals: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.globals.add((module, name))
        return super().find_class(module, name)


@pytest.mark.parametrize("kind", ["plain", "ddp", "fsdp"])
def test_real_dcp_metadata_loads_as_pickle_would(
    kind: str, tmp_path: Path, one_rank_group: None
) -> None:
    data = saved_metadata(kind, tmp_path)
    got = load_metadata(data, step=1)
    assert got == pickle.loads(data)
    assert any(isinstance(k, MetadataIndex) for k in got.storage_data)
    if kind == "fsdp":  # DTensor shards were really saved as such
        weight = got.state_dict_metadata["model.fc1.weight"]
        assert isinstance(weight, TensorStorageMetadata) and weight.size == torch.Size([29, 16])


@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_every_global_real_metadata_names_is_allowed(
    kind: str, tmp_path: Path, one_rank_group: None
) -> None:
    """Re-derives the allow-list from a real save: a torch upgrade that pickles a new
    global fails here, not in a user's restore."""
    recording = Recording(saved_metadata(kind, tmp_path))
    recording.load()
    resolved_by_name = {
        (m, n)
        for m, n in recording.globals
        if (m == "torch" and isinstance(getattr(torch, n), torch.dtype | torch.layout))
        or (m, n) == ("torch.serialization", "_get_layout")
    }
    assert recording.globals - resolved_by_name <= set(ALLOWED_CLASSES)
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in recording.globals


@dataclasses.dataclass
class Custom:
    n: int


class Reduces:
    """Unpickling it calls ``fn(*args)``: what a hostile pickle does."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


def hostile(marker: Path) -> dict[str, Any]:
    return {
        "os.system": Reduces(os.system, f"touch {marker}"),
        "builtins.eval": Reduces(eval, f"open({str(marker)!r}, 'w')"),
        "builtins.exec": Reduces(exec, f"open({str(marker)!r}, 'w')"),
        "subprocess.check_call": Reduces(subprocess.check_call, ["touch", str(marker)]),
        "pathlib.Path.touch": Reduces(Path.touch, marker),
        "torch.save": Reduces(torch.save, 0, str(marker)),
        "a class outside the list": Custom(1),
    }


@pytest.mark.parametrize(
    "what",
    [
        "os.system",
        "builtins.eval",
        "builtins.exec",
        "subprocess.check_call",
        "pathlib.Path.touch",
        "torch.save",
    ],
)
def test_hostile_metadata_is_refused_without_running(what: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = hostile(marker)[what]
    pickle.loads(pickle.dumps(payload))  # the payload is real: plain pickle runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafeCheckpointError, match="step 4 is unusable: .metadata names"):
        load_metadata(pickle.dumps(payload), step=4)
    assert not marker.exists()


def test_a_hostile_object_inside_real_metadata_is_refused(
    tmp_path: Path, one_rank_group: None
) -> None:
    marker = tmp_path / "ran"
    metadata = pickle.loads(saved_metadata("plain", tmp_path / "ckpt"))
    metadata.planner_data = {"x": Reduces(os.system, f"touch {marker}")}
    with pytest.raises(UnsafeCheckpointError, match=r"names posix\.system"):
        load_metadata(pickle.dumps(metadata), step=2)
    assert not marker.exists()


def test_a_class_outside_the_list_is_refused_before_it_is_imported() -> None:
    # GLOBAL of a module that does not exist: resolving it would raise ModuleNotFoundError
    data = b"cno_such_module_ctj\nAnything\n)R."
    with pytest.raises(UnsafeCheckpointError, match="no_such_module_ctj.Anything"):
        load_metadata(data, step=1)
    data = pickle.dumps(Custom(1))
    with pytest.raises(UnsafeCheckpointError, match="test_safe_pickle.Custom, which is not"):
        load_metadata(data, step=1)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch", "load"),
        ("torch", "save"),
        ("torch", "Tensor"),
        ("torch", "float32.__class__"),
        ("collections", "Counter"),
        ("pathlib", "Path"),
    ],
)
def test_torch_names_resolve_only_to_dtypes_layouts_and_formats(module: str, name: str) -> None:
    with pytest.raises(pickle.UnpicklingError):
        MetadataUnpickler(io.BytesIO(b"")).find_class(module, name)
    unpickler = MetadataUnpickler(io.BytesIO(b""))
    assert unpickler.find_class("torch", "bfloat16") is torch.bfloat16
    assert unpickler.find_class("torch", "channels_last") is torch.channels_last


class ByName:
    """Pickles as ``getattr(target, name)``: how Python 3.11.2 pickles an enum member."""

    def __init__(self, target: object, name: str) -> None:
        self.target, self.name = target, name

    def __reduce__(self) -> tuple[Any, tuple[object, str]]:
        return getattr, (self.target, self.name)


def test_an_enum_member_pickled_by_name_loads_as_itself() -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    for member in _MEM_FORMAT_ENCODING:
        data = pickle.dumps({"format": ByName(_MEM_FORMAT_ENCODING, member.name)})
        assert b"getattr" in data
        assert MetadataUnpickler(io.BytesIO(data)).load() == {"format": member}


@pytest.mark.parametrize(
    ("target", "name"),
    [(collections.OrderedDict, "fromkeys"), (Metadata, "__init__"), (MetadataIndex, "__class__"),
     ("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", "__class__"),
     ("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", "_member_map_")],
)  # fmt: skip
def test_getattr_is_only_an_enum_member_lookup(target: object, name: str) -> None:
    if isinstance(target, str):
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as target
    with pytest.raises(pickle.UnpicklingError):
        MetadataUnpickler(io.BytesIO(pickle.dumps(ByName(target, name)))).load()


def test_layouts_resolve_by_name_only() -> None:
    layout = MetadataUnpickler(io.BytesIO(b"")).find_class("torch.serialization", "_get_layout")
    assert layout("torch.strided") is torch.strided
    for bad in ("os.system", "torch.load", "torch.float32", 3):
        with pytest.raises(pickle.UnpicklingError):
            layout(bad)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (pickle.dumps({"a": 1}), "holds a dict, not DCP Metadata"),
        (b"\x80\x04garbage", "does not unpickle as DCP metadata"),
        (b"", "does not unpickle as DCP metadata"),
        (b"P0\n.", "does not unpickle as DCP metadata"),
    ],  # a persistent id
)
def test_what_is_not_metadata_is_unsafe_not_a_crash(data: bytes, reason: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match=reason):
        load_metadata(data, step=1)


@pytest.mark.parametrize(
    "name", ["../evil", "/tmp/x", "a/b", "a\\b", "..", ".", "", "x\0y", "x\ny", 7, None]
)
def test_file_names_that_leave_the_directory_are_refused(name: object) -> None:
    with pytest.raises(UnsafeCheckpointError, match="is not a plain name"):
        check_file_name(name, step=1)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "x..y", "model weights.bin"])
def test_plain_file_names_pass(name: str) -> None:
    assert check_file_name(name, step=1) == name


def small_metadata() -> tuple[Metadata, dict[str, int]]:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    w = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([4, 2]),
        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))],
    )
    md = Metadata(
        state_dict_metadata={"w": w, "step": BytesStorageMetadata()},
        storage_data={
            MetadataIndex("w", torch.Size([0, 0]), 0): ("__0_0.distcp", 0, 32),
            MetadataIndex("step"): ("__0_1.distcp", 0, 10),
        },
    )
    return md, {"__0_0.distcp": 32, "__0_1.distcp": 10}


def test_well_formed_metadata_passes_its_checks() -> None:
    md, sizes = small_metadata()
    check_metadata(md, step=1, file_sizes=sizes)


@pytest.mark.parametrize(
    ("storage", "reason"),
    [
        (("../evil", 0, 32), "a file the checkpoint does not have"),
        (("__0_0.distcp", 8, 32), "past the end"),
        (("__0_0.distcp", 0, 16), "a length its shape does not have"),
        (("__0_0.distcp", -1, 32), "not \\(file, offset, length\\)"),
        ("__0_0.distcp", "not \\(file, offset, length\\)"),
    ],
)
def test_metadata_placing_items_outside_the_checkpoint_is_refused(
    storage: object, reason: str
) -> None:
    md, sizes = small_metadata()
    md.storage_data[MetadataIndex("w", torch.Size([0, 0]), 0)] = storage
    with pytest.raises(UnsafeCheckpointError, match=reason):
        check_metadata(md, step=1, file_sizes=sizes)


def test_storage_locations_of_both_writers() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    assert storage_location(("f", 1, 2)) == ("f", 1, 2)
    assert storage_location(_StorageInfo("f", 1, 2)) == ("f", 1, 2)
    assert storage_location(("f", True, 2)) is None


def saved_value(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_values_load_by_weights_only_rules() -> None:
    rng = torch.arange(3)
    plain = {"step": 3, "pos": [1, 2.5, "x", None, (True,)], "rng": rng}
    got = decode_value(saved_value(plain), step=3, fqn="extra.state", trusted=False)
    assert got["pos"] == plain["pos"] and torch.equal(got["rng"], rng)


def test_a_hostile_value_is_refused_naming_step_and_item(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    data = saved_value(Reduces(os.system, f"touch {marker}"))
    with pytest.raises(UnsafeCheckpointError) as info:
        decode_value(data, step=9, fqn="extra.rng", trusted=False)
    assert "step 9" in str(info.value) and "'extra.rng'" in str(info.value)
    assert "weights_only" in str(info.value) and "CTJ_TRUST_PICKLED_VALUES" in str(info.value)
    assert not marker.exists()


def test_trust_pickled_values_loads_a_custom_class() -> None:
    data = saved_value(Custom(5))
    with pytest.raises(UnsafeCheckpointError, match="refused by torch.load"):
        decode_value(data, step=1, fqn="extra.obj", trusted=False)
    assert decode_value(data, step=1, fqn="extra.obj", trusted=True) == Custom(5)


@pytest.mark.parametrize(
    "exc",
    [
        CorruptCheckpointError(3, "abc", "is missing"),
        UnsafeCheckpointError(3, "value 'extra.x'", "is refused"),
        StateMismatch("checkpoint step 3 does not match"),
        StoreUnavailable("the store is unreachable"),
    ],
)
def test_failures_survive_the_pickle_dcp_sends_them_through(exc: CheckpointError) -> None:
    """DCP gathers a rank's failure to every rank by pickle: a corrupt chunk on one rank
    must reach the others as itself, not as a TypeError from its constructor."""
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    if isinstance(exc, CorruptCheckpointError):
        assert isinstance(back, CorruptCheckpointError)
        assert (back.step, back.chunk_id, back.reason) == (exc.step, exc.chunk_id, exc.reason)


def wrapped(*failures: BaseException) -> CheckpointException:
    """As DCP raises them: every rank's (exception, traceback) by rank."""
    no_trace = traceback.StackSummary()
    return CheckpointException("read", {r: (e, no_trace) for r, e in enumerate(failures)})


def test_a_store_outage_surfaces_as_itself_not_as_a_mismatch() -> None:
    outage = StoreUnavailable("the S3 endpoint is unreachable after 2 attempts")
    exc = wrapped(ValueError("unrelated"), outage)
    assert find_corruption(exc) is None
    assert real_error(exc) is outage


def test_a_mismatch_is_named_as_such() -> None:
    mismatch = StateMismatch("checkpoint step 1 does not match the state being loaded")
    assert real_error(wrapped(mismatch, mismatch)) is mismatch


def test_an_unexpected_error_surfaces_as_itself() -> None:
    bug = KeyError("fc1.weight")
    assert real_error(wrapped(bug)) is bug
    assert real_error(bug) is bug


def test_corruption_on_any_rank_is_found_inside_dcp_wrapping() -> None:
    corrupt = CorruptCheckpointError(2, "abc", "fails its hash check")
    outer = RuntimeError("while reading")
    outer.__cause__ = corrupt
    assert find_corruption(wrapped(ValueError("x"), outer)) is corrupt
    assert find_corruption(wrapped(ValueError("x"))) is None
