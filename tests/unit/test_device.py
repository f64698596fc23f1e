"""Which device the library's own collectives and copies use, checked on a CPU machine.

NCCL groups take CUDA tensors only; gloo and no group keep the host. Staging a CPU
state must never touch ``torch.cuda`` (a CPU run initialises no CUDA, needs no driver).
bench/gpu_check.py runs the GPU side of the same paths on a real GPU.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from trainer_sidecar import collectives
from trainer_sidecar.errors import CheckpointError
from trainer_sidecar.save import device as staging_device
from trainer_sidecar.save import staging


@pytest.mark.parametrize(
    ("backend", "want"),
    [
        ("gloo", "cpu"),
        ("nccl", "cuda"),
        ("NCCL", "cuda"),
        ("cuda:nccl", "cuda"),
        ("cpu:gloo,cuda:nccl", "cpu"),  # a CPU backend among them: objects stay on the host
        ("cuda:nccl,cpu:gloo", "cpu"),
        ("mpi", "cpu"),
        ("ucc", "cpu"),
        ("xccl", "xpu"),
        ("a-custom-backend", "cpu"),  # unknown: the host, as before devices were chosen
    ],
)
def test_backend_name_gives_the_collectives_device_type(backend: str, want: str) -> None:
    assert collectives.device_type(backend) == want


class FakeGroup:
    def __init__(self, backend: str, bound: torch.device | None = None) -> None:
        self.backend = backend
        self.bound_device_id = bound


@pytest.fixture
def in_group(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pretend a process group is up; get_backend reads the fake group's backend."""

    def use(group: FakeGroup, current_cuda: int | None = None) -> FakeGroup:
        monkeypatch.setattr(collectives, "active", lambda group=None: True)
        monkeypatch.setattr(dist, "get_backend", lambda g=None: g.backend)
        monkeypatch.setattr(dist, "get_rank", lambda g=None: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda g=None: 2)
        if current_cuda is None:
            monkeypatch.setattr(torch.cuda, "current_device", _no_cuda)
        else:
            monkeypatch.setattr(torch.cuda, "current_device", lambda: current_cuda)
        return group

    return use


def _no_cuda(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("torch.cuda was touched")


def test_no_process_group_is_the_cpu() -> None:
    assert not dist.is_initialized()
    assert collectives.device() == torch.device("cpu")
    assert collectives.device(FakeGroup("nccl")) == torch.device("cpu")


def test_gloo_group_is_the_cpu_without_asking_cuda(in_group: Any) -> None:
    group = in_group(FakeGroup("gloo"))
    assert collectives.device(group) == torch.device("cpu")


def test_nccl_group_is_the_current_cuda_device(in_group: Any) -> None:
    group = in_group(FakeGroup("nccl"), current_cuda=3)
    assert collectives.device(group) == torch.device("cuda", 3)
    bound = in_group(FakeGroup("nccl", bound=torch.device("cuda", 3)), current_cuda=3)
    assert collectives.device(bound) == torch.device("cuda", 3)


def test_nccl_group_bound_to_another_gpu_names_set_device(in_group: Any) -> None:
    group = in_group(FakeGroup("nccl", bound=torch.device("cuda", 1)), current_cuda=0)
    with pytest.raises(CheckpointError, match=r"torch\.cuda\.set_device\(cuda:1\)"):
        collectives.device(group)


def test_any_rank_without_a_process_group_is_the_flag() -> None:
    assert collectives.any_rank(True) is True
    assert collectives.any_rank(False) is False


def test_any_rank_reduces_a_tensor_on_the_group_device(
    in_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = in_group(FakeGroup("gloo"))
    seen: list[tuple[torch.device, Any, Any]] = []

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        seen.append((t.device, op, group))
        t.fill_(1)  # another rank's flag was up

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert collectives.any_rank(False, group) is True
    assert seen == [(torch.device("cpu"), dist.ReduceOp.MAX, group)]


@pytest.mark.parametrize(
    ("backend", "current", "want"),
    [("gloo", None, torch.device("cpu")), ("nccl", 2, torch.device("cuda", 2))],
)
def test_object_broadcast_passes_the_group_device(
    in_group: Any,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    current: int | None,
    want: torch.device,
) -> None:
    group = in_group(FakeGroup(backend), current_cuda=current)
    calls: list[dict[str, Any]] = []

    def broadcast_object_list(box: list[Any], **kwargs: Any) -> None:
        calls.append(kwargs)

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    assert collectives.decided_by_rank0(lambda: 42, group) == 42
    assert calls == [{"src": 0, "group": group, "device": want}]


# -------------------------------------------------------------------------- staging


@pytest.fixture
def cuda_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch.cuda entry point staging could reach raises."""
    for name in (
        "is_available",
        "cudart",
        "current_device",
        "current_stream",
        "synchronize",
        "init",
        "_lazy_init",
    ):
        monkeypatch.setattr(torch.cuda, name, _no_cuda)


def _stage(state: dict[str, Any], slot: Path) -> list[Any]:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plan = planner.create_local_plan()
    tensor_items, byte_items = staging.file_order(plan.items)
    results, _ = staging.stage_items(slot, 0, tensor_items, byte_items, planner)
    return results


def test_staging_cpu_tensors_never_touches_cuda(cuda_forbidden: None, tmp_path: Path) -> None:
    state: dict[str, Any] = {
        "a": torch.arange(3, dtype=torch.int8),  # 3 bytes: the next tensor is misaligned
        "b": torch.randn(5, 7),
        "c": torch.randn(4, 6).t(),  # not contiguous
        "step": 7,
    }
    slot = tmp_path / "slot-0"
    try:
        results = _stage(state, slot)
        data = (slot / "__0_0.distcp").read_bytes()
        by_name = {r.index.fqn: r.storage_data for r in results}
        for name in ("a", "b", "c"):
            _, offset, length = by_name[name]
            want = state[name].contiguous().reshape(-1).view(torch.uint8)
            got = torch.frombuffer(bytearray(data[offset : offset + length]), dtype=torch.uint8)
            assert torch.equal(got, want), name
        assert not staging.mapped(slot / "__0_0.distcp").pinned
    finally:
        staging.mapped(slot / "__0_0.distcp").close()
    assert not torch.cuda.is_initialized()


def test_slot_is_pinned_once_per_mapping_and_unpinned_before_unmapping(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, int]] = []

    def register(ptr: int, size: int) -> bool:
        calls.append(("register", ptr))
        return True

    monkeypatch.setattr(staging_device, "register", register)
    monkeypatch.setattr(staging_device, "unregister", lambda ptr: calls.append(("unregister", ptr)))
    mapping = staging._MappedFile(tmp_path / "__0_0.distcp")
    first = mapping.ensure(4096).data_ptr()
    assert mapping.pin() and mapping.pin()
    assert calls == [("register", first)]
    mapping.ensure(4096)  # same layout: the same pinned mapping
    assert mapping.pin() and calls == [("register", first)]
    second = mapping.ensure(8192).data_ptr()  # a new layout remaps: unpinned first
    assert calls == [("register", first), ("unregister", first)] and not mapping.pinned
    assert mapping.pin()
    mapping.close()
    assert calls[2:] == [("register", second), ("unregister", second)]


def test_a_slot_that_cannot_be_pinned_is_tried_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tries: list[int] = []

    def register(ptr: int, size: int) -> bool:
        tries.append(ptr)
        return False

    monkeypatch.setattr(staging_device, "register", register)
    monkeypatch.setattr(staging_device, "unregister", _no_cuda)
    mapping = staging._MappedFile(tmp_path / "__0_0.distcp")
    mapping.ensure(4096)
    assert not mapping.pin() and not mapping.pin()
    assert len(tries) == 1
    mapping.close()  # never pinned: nothing to unpin


def test_register_failure_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(staging_device, "_warned", False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: (_ for _ in ()).throw(RuntimeError("no")))
    with caplog.at_level(logging.WARNING, logger="ctj.staging"):
        assert not staging_device.register(0x1000, 4096)
        assert not staging_device.register(0x2000, 4096)
    assert [r.message.count("could not pin the staging slot") for r in caplog.records] == [1]


def test_non_blocking_copy_of_a_cpu_tensor_is_the_same_bytes() -> None:
    src = torch.randn(9)
    dst = torch.zeros(40, dtype=torch.uint8)
    staging._copy_into(dst[1:37], src, non_blocking=True)  # misaligned: the byte copy
    assert torch.equal(dst[1:37], src.view(torch.uint8))
    staging._copy_into(dst[4:40], src, non_blocking=True)  # aligned: the typed copy
    assert torch.equal(dst[4:40], src.view(torch.uint8))


# -------------------------------------------------------------------------- gpu_check

GPU_CHECK = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_gpu_check_parses_its_arguments_without_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, str(GPU_CHECK), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "--cpu" in done.stdout and "--mib" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_without_a_gpu_says_so() -> None:
    done = subprocess.run(
        [sys.executable, str(GPU_CHECK)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr
