"""The DCP reader writes saved bytes straight into a CPU tensor where it can, and copies
(casting) where it cannot; both load the saved values bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.load import dcp_reader
from trainer_sidecar.load.chunk_reader import ChunkReader
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.s3 import open_store


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(300, 700))  # spans several 1 MiB blocks
        self.b = torch.nn.Parameter(torch.randn(700))
        self.register_buffer("table", torch.randn(33, 5).to(torch.bfloat16))
        self.register_buffer("scalar", torch.tensor(3.5))


def saved(tmp_path: Path) -> tuple[CheckpointConfig, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    net = Net()
    config = CheckpointConfig(uri=f"file://{tmp_path}/ckpt", keep_last=0)
    with Checkpointer(config) as ckpt:
        pending = ckpt.save(1, model=net)
        assert pending is not None
        pending.result()
    return config, {k: v.clone() for k, v in net.state_dict().items()}


def test_a_load_writes_contiguous_cpu_tensors_in_place_and_copies_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, want = saved(tmp_path)
    used: list[bool] = []
    real = dcp_reader.ChunkedStorageReader._in_place

    def spy(self: dcp_reader.ChunkedStorageReader, *args: object) -> memoryview | None:
        found = real(self, *args)  # type: ignore[arg-type]
        used.append(found is not None)
        return found

    monkeypatch.setattr(dcp_reader.ChunkedStorageReader, "_in_place", spy)
    net = Net()
    net.w.data = torch.zeros(700, 300).t()  # not contiguous: must go through copy_
    with torch.no_grad():
        for t in net.state_dict().values():
            t.zero_()
    with Checkpointer(config) as ckpt:
        result = ckpt.load(model=net)
    assert result is not None and result.step == 1
    for name, value in net.state_dict().items():
        assert torch.equal(value, want[name]), name
    assert True in used and False in used  # both paths ran


def test_a_range_split_across_chunks_is_gathered_into_the_given_buffer(tmp_path: Path) -> None:
    config, _ = saved(tmp_path)
    store = open_store(config.uri)
    reader = ChunkReader(store, repo.read_manifest(store, 1))
    name, entry = max(reader.manifest.files.items(), key=lambda kv: kv[1].size)
    assert len(entry.chunks) > 1
    whole = reader.read_file(name)
    a, b = 5, entry.chunks[0].size + 7  # crosses a chunk boundary
    out = bytearray(b - a)
    got, view = reader.read_ranges([(name, a, b), (name, 1, 9)], into=[memoryview(out), None])
    assert bytes(out) == whole[a:b] and got.obj is out
    assert view == whole[1:9] and view.readonly  # within one fetch: a view, no copy
    with pytest.raises(ValueError, match="buffer of 3 bytes"):
        reader.read_ranges([(name, 0, 4)], into=[memoryview(bytearray(3))])


def test_in_place_is_refused_for_a_cast(tmp_path: Path) -> None:
    config, _ = saved(tmp_path)
    store = open_store(config.uri)
    reader = ChunkReader(store, repo.read_manifest(store, 1))
    storage = dcp_reader.ChunkedStorageReader(reader)
    metadata = dcp_reader.read_checked_metadata(reader)
    storage.set_up_storage_reader(metadata, True)
    index = next(i for i in metadata.storage_data if i.fqn == "model.table")
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=torch.Size([0, 0]),
        storage_index=index,
        storage_offsets=torch.Size([0, 0]),
        lengths=torch.Size([33, 5]),
    )
    nbytes = 33 * 5 * 2
    assert storage._in_place(item, torch.empty(33, 5, dtype=torch.bfloat16), nbytes) is not None
    assert storage._in_place(item, torch.empty(33, 5, dtype=torch.float32), nbytes) is None
    narrowed = item.__class__(**{**item.__dict__, "lengths": torch.Size([33, 4])})
    assert storage._in_place(narrowed, torch.empty(33, 4, dtype=torch.bfloat16), 33 * 5 * 2) is None
