"""Rank functions of the chaos and fencing tests, and the values they save.

Nothing here trains. Every tensor of the state (parameters and AdamW's state) is set
directly from a generator seeded by ``(attempt, step, name)``, so the state a save of
step ``s`` by attempt ``a`` staged is computable anywhere, at any world size:
``expected_state(a, s)``. A checkpoint that mixes two saves (rank 0's part from one,
rank 1's from another) shows up as shards of the wrong values.

Some tensors change only every other step and AdamW's second moment never changes
within an attempt, so incremental and differential saves really do skip chunks (and
gc has referenced-but-old chunks to keep).

The ranks are forked from a forkserver that preloaded this module (rank_preload.py), so
a rank costs a fork instead of importing torch; ``rank_main`` runs a ``run_*`` function
after ``init_process_group``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - preloaded for the forked ranks (FSDP2 imports it: ~2s)
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict  # noqa: F401 - preloaded, as above
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import trainer_sidecar.load.restore  # noqa: F401 - preloaded, as above
import trainer_sidecar.save.protocol  # noqa: F401
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.checkpointer import PendingSave
from trainer_sidecar.errors import SaveFailed

# -- the model and its values -------------------------------------------------------------


class ChaosNet(torch.nn.Module):
    """About 50k parameters (600 KB with AdamW's state): 3-5 64 KiB chunks per rank.
    Row counts (257, 157, 3) that no world size of 2-4 divides: uneven and empty shards."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 257)
        self.norm = torch.nn.LayerNorm(257)
        self.fc2 = torch.nn.Linear(257, 157)
        self.fc3 = torch.nn.Linear(157, 3)


SLOW = ("fc1.", "norm.")  # parameters (and their first moment) that change every other step


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _tick(name: str, kind: str, step: int) -> int:
    """Which step's values this tensor holds at ``step``."""
    if kind == "exp_avg_sq":
        return 0  # fixed for the whole attempt
    return step // 2 if name.startswith(SLOW) else step


def expected_tensor(
    attempt: str, step: int, name: str, kind: str, shape: tuple[int, ...]
) -> torch.Tensor:
    gen = _generator(attempt, _tick(name, kind, step), name, kind)
    full = torch.randn(shape, generator=gen)
    return full.abs() if kind == "exp_avg_sq" else full


def step_value(attempt: str, step: int) -> float:
    """AdamW's (replicated) step counter: distinct for every (attempt, step)."""
    return float(step) + float(torch.rand((), generator=_generator(attempt, step, "step")))


def full_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}  # DTensor: global shape


def expected_state(attempt: str, step: int) -> dict[str, Any]:
    """The full (unsharded) state a save of ``step`` by ``attempt`` staged."""
    shapes = full_shapes(ChaosNet())
    return {
        "model": {n: expected_tensor(attempt, step, n, "param", s) for n, s in shapes.items()},
        "optim": {
            n: {
                "step": torch.tensor(step_value(attempt, step)),
                "exp_avg": expected_tensor(attempt, step, n, "exp_avg", s),
                "exp_avg_sq": expected_tensor(attempt, step, n, "exp_avg_sq", s),
            }
            for n, s in shapes.items()
        },
        "extra": {"attempt": attempt, "step": step},
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` as ``like`` (a DTensor sharded on dim 0, or a plain
    tensor) holds it: torch.chunk's split, empty past the last chunk."""
    if not isinstance(like, DTensor):
        return full
    rank = like.device_mesh.get_local_rank()
    pieces = torch.chunk(full, like.device_mesh.size(), dim=0)
    part = pieces[rank] if rank < len(pieces) else full[0:0]
    assert part.shape == like.to_local().shape, (part.shape, like.to_local().shape)
    return part


def build(*, sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2 over the world when ``sharded``) and an AdamW with its state made
    (zeros, no step taken), so a load has somewhere to put the saved state."""
    torch.manual_seed(0)
    model = ChaosNet()
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model.fc1, model.fc2, model.fc3):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return model, opt


def set_values(model: torch.nn.Module, opt: torch.optim.Optimizer, attempt: str, step: int) -> None:
    """Put attempt's values for ``step`` into this rank's shards, in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            _local(p).copy_(_shard(expected_tensor(attempt, step, name, "param", shape), p))
            state = opt.state[p]
            for kind in ("exp_avg", "exp_avg_sq"):
                full = expected_tensor(attempt, step, name, kind, shape)
                _local(state[kind]).copy_(_shard(full, state[kind]))
            state["step"].fill_(step_value(attempt, step))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def mismatches(
    model: torch.nn.Module, opt: torch.optim.Optimizer, attempt: str, step: int
) -> list[str]:
    """The tensors (of this rank's shards) that are not bitwise attempt's values for step."""
    bad = []
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        pairs = [("param", p)] + [(k, opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")]
        for kind, t in pairs:
            want = _shard(expected_tensor(attempt, step, name, kind, shape), t)
            if not torch.equal(_bits(_local(t)), _bits(want)):
                bad.append(f"{name}:{kind}")
        if not torch.equal(
            _bits(opt.state[p]["step"]), _bits(torch.tensor(step_value(attempt, step)))
        ):
            bad.append(f"{name}:step")
    return bad


def which_values(
    model: torch.nn.Module, opt: torch.optim.Optimizer, candidates: list[tuple[str, int]]
) -> dict[str, str]:
    """For a mismatch report: whose values each tensor holds, among ``candidates``."""
    found: dict[str, str] = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        pairs = [("param", p)] + [(k, opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")]
        for kind, t in pairs:
            owners = [
                f"{a}@{s}"
                for a, s in candidates
                if torch.equal(
                    _bits(_local(t)),
                    _bits(_shard(expected_tensor(a, s, name, kind, shape), t)),
                )
            ]
            found[f"{name}:{kind}"] = ",".join(owners) or "nobody"
    return found


# -- the rank processes -------------------------------------------------------------------


def say(line: str) -> None:
    print(line, flush=True)


def _wait_for_file(path: str, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} ({path})")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _touch(path: str) -> None:
    Path(path + ".tmp").write_text("")
    os.replace(path + ".tmp", path)


class Results:
    """Rank 0's record of what became of each save: RESULT lines in its log."""

    def __init__(self, attempt: str) -> None:
        self.attempt = attempt
        self.open: list[PendingSave] = []

    def add(self, pending: PendingSave) -> None:
        self.open.append(pending)

    def report(self, *, block: bool, timeout: float = 60) -> None:
        still = []
        for p in self.open:
            if not block and not p.done():
                still.append(p)
                continue
            try:
                p.result(timeout=timeout)
                say(f"RESULT committed {self.attempt} {p.step} {p.save.nonce}")
            except SaveFailed as exc:
                kind = type(exc).__name__
                say(f"RESULT raised {self.attempt} {p.step} {p.save.nonce} {kind}: {exc}")
        self.open = still


def run_trainer(args: dict[str, Any]) -> None:
    """One rank of a job: optionally load the latest checkpoint (and check that it is
    exactly ``expect_attempt``'s values for its step), then save ``steps`` steps after it.

    args: steps; load (bool); expect_attempt (what the load must find);
    gate (optional path prefix: wait for ``<gate>.<step>`` before saving that step);
    sync (optional: {"mine": prefix, "theirs": prefix}, rank 0 keeps step with another job);
    hold (optional: after the saves, stay alive (no close) until killed).
    """
    rank = dist.get_rank()
    attempt = os.environ["CTJ_ATTEMPT"]
    model, opt = build(sharded=True)
    ckpt = Checkpointer(CheckpointConfig.from_env())
    first = 1
    if args.get("load"):
        extra: dict[str, Any] = {"attempt": "", "step": -1}
        loaded = ckpt.load(model=model, optimizer=opt, extra=extra)
        if loaded is None:
            say("LOADED none")
        else:
            assert extra["step"] == loaded.step, (extra, loaded.step)
            assert not loaded.skipped, f"LOST: newer checkpoints {loaded.skipped} were unusable"
            want = args.get("expect_attempt", extra["attempt"])
            assert extra["attempt"] == want, f"MIXED: step {loaded.step} extra is {extra}"
            bad = mismatches(model, opt, want, loaded.step)
            if bad:
                owners = which_values(model, opt, [(want, loaded.step), (attempt, loaded.step)])
                raise AssertionError(
                    f"MIXED: rank {rank} loaded step {loaded.step} but {bad[:6]} are not "
                    f"attempt {want}'s values; whose they are: {owners}"
                )
            say(f"LOADED {loaded.step} {extra['attempt']} ok")
            first = loaded.step + 1
    results = Results(attempt)
    sync = args.get("sync")
    for step in range(first, first + int(args["steps"])):
        if args.get("gate"):
            _wait_for_file(f"{args['gate']}.{step}", f"the test's go for step {step}")
        if sync and rank == 0 and step > first:
            _wait_for_file(f"{sync['theirs']}.{step - 1}", f"the other job to stage {step - 1}")
        set_values(model, opt, attempt, step)
        say(f"SAVING {step}")
        pending = ckpt.save(
            step, model=model, optimizer=opt, extra={"attempt": attempt, "step": step}
        )
        assert pending is not None
        say(f"STAGED {step} {pending.save.nonce}")
        if sync and rank == 0:
            _touch(f"{sync['mine']}.{step}")
        if rank == 0:
            results.add(pending)
            results.report(block=False)
    if args.get("hold"):
        say("HOLDING")
        while True:
            if rank == 0:
                results.report(block=False)
            time.sleep(0.05)
    if rank == 0:
        results.report(block=True)
    ckpt.close()
    say("DONE")


def rank_main(target: str, args: dict[str, Any]) -> None:
    """A forked rank (ctj_devcluster.forked.ForkedProcess gave it its environment and
    log): ``target(args)`` in the group. An exception ends it with 1 and its traceback."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    fn = globals()[target]
    dist.init_process_group("gloo")
    fn(args)
    dist.destroy_process_group()
