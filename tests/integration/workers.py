"""Rank functions for the multi-process tests (run by tests.integration.ranks)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from trainer_sidecar import CheckpointConfig, Checkpointer


class Net(torch.nn.Module):
    """Row counts (29, 3) that no world size of 2-4 divides evenly: uneven and empty shards."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 29)
        self.norm = torch.nn.LayerNorm(29)
        self.fc2 = torch.nn.Linear(29, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class WideNet(Net):
    """Net with a wider layer (301 uneven rows of fp32, cut into several chunks at small
    chunk sizes) and a bf16 buffer (replicated): byte-plane codecs get whole-tensor chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = torch.nn.Linear(64, 301)
        self.register_buffer("table", torch.randn(5003, 4).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.wide(torch.cat([x] * 4, dim=1)).mean(dim=1, keepdim=True)
        return super().forward(x) + extra * self.table[0, 0].float()


class BigNet(Net):
    """Net with a 768 KiB first layer: its shards span many 64 KiB blocks (tier tests)."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.fc1 = torch.nn.Linear(16, 12288)
        self.norm = torch.nn.LayerNorm(12288)
        self.fc2 = torch.nn.Linear(12288, 3)


def build(kind: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """kind: "fsdp" (FSDP2, sharded), "ddp" (replicated), "wide" (WideNet, FSDP2), "big"
    (BigNet, FSDP2), or plain."""
    torch.manual_seed(seed)
    nets: dict[str, type[Net]] = {"wide": WideNet, "big": BigNet}
    model: torch.nn.Module = nets.get(kind, Net)()
    if kind in ("fsdp", "wide", "big"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        layers = [model.fc1, model.fc2] + ([model.wide] if kind == "wide" else [])
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state gathered to full tensors on rank 0 (empty elsewhere)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, opt, options=options).get("state", {}),
    }
    # replicated tensors (the optimizer's step) come back as the live objects: copy them
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, state)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


def assert_bitwise_equal(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_bitwise_equal(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(_raw(got), _raw(want)), (path, got.flatten()[:4], want.flatten()[:4])
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def config(args: dict[str, Any]) -> CheckpointConfig:
    return CheckpointConfig(uri=args["uri"], **args.get("config", {}))


def save(args: dict[str, Any]) -> None:
    """Train a little, save at args['step'], write the gathered reference state."""
    _save(args, config(args))


def _save(args: dict[str, Any], cfg: CheckpointConfig) -> None:
    model, opt = build(args["kind"], seed=0)
    train(model, opt, 2)
    pending = Checkpointer(cfg).save(
        args["step"], model=model, optimizer=opt, extra={"step": args["step"], "pos": 7}
    )
    ref = full_state(model, opt)
    train(model, opt, 1)  # the parameters may change as soon as save() returns
    pending.result()
    if dist.get_rank() == 0:
        torch.save(ref, args["ref"])


def load_and_compare(args: dict[str, Any]) -> None:
    """Fresh (differently initialised) model at this world size: load, compare bitwise."""
    model, opt, _, tensors = _load_checked(args, config(args))
    if tensors is not None:
        print(f"bitwise equal: {tensors} tensors at world size {dist.get_world_size()}")
    train(model, opt, 1)  # the loaded state trains on


def _load_checked(
    args: dict[str, Any], cfg: CheckpointConfig
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, int | None]:
    """Load into a fresh model and check it: (model, optimizer, the LoadResult, the tensors
    compared bitwise with the reference on rank 0, None elsewhere)."""
    model, opt = build(args["kind"], seed=123)
    extra: dict[str, Any] = {"step": -1, "pos": -1}
    result = Checkpointer(cfg).load(model=model, optimizer=opt, extra=extra)
    assert result is not None and result.step == args["step"], result
    assert extra == {"step": args["step"], "pos": 7}, extra
    got = full_state(model, opt)
    if dist.get_rank() != 0:
        return model, opt, result, None
    want = torch.load(args["ref"], weights_only=True)
    assert_bitwise_equal(got, want)
    return model, opt, result, len(torch.utils._pytree.tree_leaves(want))


class HangingStore:
    """A real store that stops dead once ``limit`` puts have completed: a save frozen
    mid-upload. Uploads run on several threads, so the marker is written only after
    the first ``limit`` puts are really stored."""

    def __init__(self, inner: Any, limit: int, marker: str) -> None:
        self.inner, self.limit, self.marker = inner, limit, marker
        self.started = self.done = 0
        self.cond = threading.Condition()

    def put(self, key: str, data: Any, *, if_absent: bool = False) -> None:
        with self.cond:
            mine = self.started
            self.started += 1
        if mine < self.limit:
            self.inner.put(key, data, if_absent=if_absent)
            with self.cond:
                self.done += 1
                self.cond.notify_all()
            return
        with self.cond:
            self.cond.wait_for(lambda: self.done >= self.limit)
            with open(self.marker, "w") as f:
                f.write(key)
        threading.Event().wait()  # until SIGKILL

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def save_then_die_mid_upload(args: dict[str, Any]) -> None:
    """Commit step 1, then freeze step 2 after a few chunk uploads (the test kills -9)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    ckpt = Checkpointer(config(args))
    ckpt.save(1, model=model).result()
    ckpt.close()
    torch.save(model.state_dict(), args["ref"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    hanging = HangingStore(ckpt.store, limit=3, marker=args["marker"])
    Checkpointer(config(args), store=hanging).save(2, model=model).result()
    raise AssertionError("the save should have hung")


def stock_load_of_export(args: dict[str, Any]) -> None:
    """Single process, no ctj reader: stock DCP loads the exported directory."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(42)
    plain = Net()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=args["export_dir"])  # FileSystemReader
    want = torch.load(args["ref"], weights_only=True)["model"]
    assert_bitwise_equal(state["model"], want)
    whole = torch.load(args["torch_save"], weights_only=False)
    assert_bitwise_equal(whole["model"], want)
    assert whole["extra"] == {"step": args["step"], "pos": 7}


def save_and_freeze(args: dict[str, Any]) -> None:
    """Stage a save for the sidecar, write the reference, signal, and wait to be killed."""
    model, opt = build(args["kind"], seed=0)
    train(model, opt, 2)
    Checkpointer(config(args)).save(
        args["step"], model=model, optimizer=opt, extra={"step": args["step"], "pos": 7}
    )
    ref = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(ref, args["ref"])
    dist.barrier()
    with open(f"{args['marker']}.{dist.get_rank()}", "w") as f:
        f.write("staged")
    threading.Event().wait()  # until SIGKILL


def train_until_preempted(args: dict[str, Any]) -> None:
    """A training loop that saves once, at the next step boundary after SIGTERM, and exits."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ckpt = Checkpointer(config(args))
    ckpt.handle_sigterm()
    for step in range(1, 100_000):
        with torch.no_grad():
            model.weight.add_(0.001)
        print(f"step {step}", flush=True)
        if ckpt.preemption_requested():
            ckpt.save(step, model=model, extra={"step": step}).result()
            print(f"emergency checkpoint at step {step}", flush=True)
            ckpt.close()
            return
        time.sleep(0.01)


def save_series(args: dict[str, Any]) -> None:
    """Saves whose layout is new (step 1: the model), changes (step 2: the optimizer joins),
    then holds while the non-tensor values grow; each save's gathered state is the
    reference for its step."""
    model, opt = build(args["kind"], seed=0)
    ckpt = Checkpointer(config(args))
    replanned = []
    for step in range(1, 6):
        if step > 1:
            train(model, opt, 1)
        extra = {"step": step, "note": "x" * (1000 * step)}  # its bytes grow every save
        pending = ckpt.save(step, model=model, optimizer=opt if step > 1 else None, extra=extra)
        ref = full_state(model, opt)
        train(model, opt, 1)  # may touch the parameters as soon as save() returns
        pending.result()
        replanned.append(pending.replanned)
        if dist.get_rank() == 0:
            torch.save({"state": ref, "extra": extra}, f"{args['ref']}.{step}")
    ckpt.close()
    print(f"replanned: {replanned}")


def load_series_and_compare(args: dict[str, Any]) -> None:
    """Every step of save_series loads bitwise equal, non-tensor values included."""
    for step in range(1, 6):
        model, opt = build(args["kind"], seed=123)
        extra: dict[str, Any] = {"step": -1, "note": ""}
        result = Checkpointer(config(args)).load(
            model=model, optimizer=opt if step > 1 else None, extra=extra, step=step
        )
        assert result is not None and result.step == step, result
        got = full_state(model, opt)
        want = torch.load(f"{args['ref']}.{step}", weights_only=True)
        assert extra == want["extra"], (step, extra["step"], len(extra["note"]))
        if dist.get_rank() == 0:
            if step == 1:  # saved without the optimizer
                got, want["state"] = got["model"], want["state"]["model"]
            assert_bitwise_equal(got, want["state"])
    print(f"series bitwise equal at world size {dist.get_world_size()}")


def save_while_rank1_store_fails(args: dict[str, Any]) -> None:
    """Rank 1 reaches the store through a proxy that fails its first upload for good;
    every rank must hear of the failure from the store within seconds."""
    from trainer_sidecar.errors import SaveFailed

    model, opt = build(args["kind"], seed=0)
    overrides = dict(args.get("config", {}))
    if dist.get_rank() == 1:
        overrides.update(endpoint_url=args["rank1_endpoint"], parallelism=1)
    ckpt = Checkpointer(CheckpointConfig(uri=args["uri"], **overrides))
    pending = ckpt.save(1, model=model, optimizer=opt, extra={"step": 1})
    assert pending is not None
    started = time.monotonic()
    try:
        pending.result()
    except SaveFailed as exc:
        print(f"rank {dist.get_rank()} learned in {time.monotonic() - started:.1f}s: {exc}")
    else:
        raise AssertionError("the save committed although rank 1's upload failed")
    ckpt.close(timeout=5)


def save_while_one_ranks_store_is_down(args: dict[str, Any]) -> None:
    """Rank ``args["proxied_rank"]`` reaches the store through a proxy that is down for a
    while (longer than its own retries): the save must commit once the store is back, on
    every rank, not fail."""
    model, opt = build(args["kind"], seed=0)
    overrides = dict(args.get("config", {}))
    if dist.get_rank() == args["proxied_rank"]:
        overrides.update(endpoint_url=args["proxy_endpoint"], parallelism=1)
    ckpt = Checkpointer(CheckpointConfig(uri=args["uri"], **overrides))
    started = time.monotonic()
    pending = ckpt.save(1, model=model, optimizer=opt, extra={"step": 1})
    assert pending is not None
    result = pending.result(timeout=args["wait_s"])
    print(f"rank {dist.get_rank()} committed step {result.step} in "
          f"{time.monotonic() - started:.1f}s")  # fmt: skip
    ckpt.close(timeout=5)


def _node_config(args: dict[str, Any]) -> CheckpointConfig:
    """This rank's node: its cache directory, and the peers' cache servers (if any)."""
    rank = dist.get_rank()
    node: dict[str, Any]
    if args.get("agents"):  # a node agent per node (tests/integration/test_node_agent.py)
        ns, name, uid = args["job"]
        node = {"node_agent": args["agents"][rank], "job_namespace": ns, "job_name": name,
                "job_uid": uid, "cache_token": args["token"]}  # fmt: skip
        if args.get("mounts"):  # and its job's directory mounted (the agent's CSI volume)
            node["node_cache_mount"] = args["mounts"][rank]
    else:
        node = {
            "cache_dir": args["caches"][rank],
            "cache_max_bytes": args.get("max_bytes", 1 << 30),
        }
    if args.get("peers"):
        node.update(cache_peers=tuple(args["peers"][rank]), cache_token=args["token"])
    return CheckpointConfig(uri=args["uri"], **node, **args.get("config", {}))


def save_on_nodes(args: dict[str, Any]) -> None:
    """``save``, each rank on its own node: its chunks stay in that node's cache."""
    _save(args, _node_config(args))


def load_on_nodes(args: dict[str, Any]) -> None:
    """``load_and_compare`` through the tiers; each rank writes its bytes by tier."""
    _, _, result, tensors = _load_checked(args, _node_config(args))
    if tensors is not None:
        print(f"bitwise equal at world size {dist.get_world_size()}")
    with open(f"{args['out']}.{dist.get_rank()}.json", "w") as f:
        json.dump(result.bytes_by_tier, f)
