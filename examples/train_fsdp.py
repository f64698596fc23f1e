"""A small real training job that checkpoints with ctj and resumes at any world size.

Run it the way torchrun or a PyTorchJob pod would (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment) with the checkpoint location in
CTJ_CHECKPOINT_URI. It trains an FSDP2-sharded MLP on a synthetic regression
task on CPU (gloo), saves every CTJ_SAVE_EVERY steps, and on start loads the
latest committed checkpoint, resharded to the current world size.

Its data comes from a GlobalSampler over a fixed synthetic dataset: a global
batch of CTJ_GLOBAL_BATCH samples a step (default 192, divisible by world sizes
1 to 4), each rank training on its share. The sampler's position is a global
sample index saved in ``extra`` next to the step, so a resume at another world
size trains on exactly the samples after the checkpoint.

The ctj part is a few lines: build a Checkpointer, load, save. A save returns
once the state is staged; the upload and commit happen in the background (a
thread here, the sidecar container in a pod) while training goes on.
Each line it prints is one JSON event, for humans and for tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

STARTED = time.time()  # before torch's import: the recovery budget's "worker start"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from trainer_sidecar import CheckpointConfig, Checkpointer, GlobalSampler  # noqa: E402
from trainer_sidecar.rank_exit import exit_rank  # noqa: E402

DIM = 64
DATASET_LEN = 4096  # 21 global batches of 192 an epoch: a 60-step run spans 3 epochs


ATTEMPT = int(os.environ.get("CTJ_ATTEMPT") or 0)  # a pod kept across attempts logs several


def log(event: str, **fields: object) -> None:
    if dist.get_rank() == 0 or event in ("error",):
        line = {"t": round(time.time(), 3), "event": event, "rank": dist.get_rank(),
                "attempt": ATTEMPT, **fields}
        print(json.dumps(line), flush=True)


def build_model(world_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, 4 * DIM),
        torch.nn.GELU(), torch.nn.Linear(4 * DIM, 1),
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def samples(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` deterministic (input, target) pairs of the regression task."""
    x = torch.randn(size, DIM, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(x[:, :8].sum(dim=1, keepdim=True))


DATASET = samples(0, DATASET_LEN)  # the training set: the same on every rank and attempt
EVAL = samples(10**9, 256)


def eval_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        x, y = EVAL
        return float(torch.nn.functional.mse_loss(model(x), y))


def main() -> None:
    imported = time.time()
    dist.init_process_group("gloo")
    met = time.time()  # the rendezvous done: every rank of the attempt is up
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks in this pod (torchrun)
    total_steps = int(os.environ.get("CTJ_TOTAL_STEPS", "60"))
    save_every = int(os.environ.get("CTJ_SAVE_EVERY", "10"))
    step_delay = float(os.environ.get("CTJ_STEP_DELAY_S", "0"))
    global_batch = int(os.environ.get("CTJ_GLOBAL_BATCH", "192"))

    model = build_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = GlobalSampler(DATASET_LEN, global_batch, rank=dist.get_rank(), world_size=world)
    # leaving on an error (a peer's death breaks a collective), close() does not wait for
    # a commit that may never come: the sidecar settles what is staged
    with Checkpointer(CheckpointConfig.from_env()) as ckpt:
        ckpt.handle_sigterm()  # SIGTERM only sets a flag: the loop saves at the next boundary
        extra: dict[str, Any] = {"step": 0, "sampler": sampler.state_dict()}
        restored = ckpt.load(model=model, optimizer=opt, extra=extra)
        start = extra["step"] if restored else 0
        if restored:
            sampler.load_state_dict(extra["sampler"])  # refuses another seed, batch or dataset
            log("restored", step=restored.step, world_size=world,
                saved_world_size=restored.saved_world_size, local_world_size=local_world,
                seconds=round(restored.seconds, 3), bytes_fetched=restored.bytes_fetched,
                bytes_by_tier=restored.bytes_by_tier,
                eval_loss=eval_loss(model), started=round(STARTED, 3),
                imported=round(imported, 3), rendezvous=round(met, 3))
        else:
            log("fresh_start", world_size=world, local_world_size=local_world)

        pending: list = []  # saves staged, not yet seen committed
        stopped, last = False, start
        for step in range(start + 1, total_steps + 1):
            last = step
            indices = sampler.local_batch(sampler.step)  # this rank's share of global step `step`
            x, y = DATASET[0][indices], DATASET[1][indices]
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sampler.advance()  # the step is done: its samples count as consumed
            log("step", step=step, loss=round(float(loss.detach()), 5), world_size=world,
                samples=sampler.position)
            if step % save_every == 0:
                state = {"step": step, "sampler": sampler.state_dict()}
                pending.append(ckpt.save(step, model=model, optimizer=opt, extra=state))
                log("staged", step=step, eval_loss=eval_loss(model),
                    stall_seconds=round(pending[-1].stage_seconds, 4))
            # collective: SIGTERM on any rank, or the operator asked for a checkpoint (a planned
            # resize or drain): save at this boundary, wait for the commit below, and stop
            if ckpt.preemption_requested():
                if step % save_every != 0:  # not saved at this step already
                    state = {"step": step, "sampler": sampler.state_dict()}
                    pending.append(ckpt.save(step, model=model, optimizer=opt, extra=state))
                    log("staged", step=step, stall_seconds=round(pending[-1].stage_seconds, 4))
                log("stopping", step=step, request=ckpt.checkpoint_request())
                stopped = True
                break
            while pending and pending[0].done():
                result = pending.pop(0).result()
                log("committed", step=result.step, mode=result.mode,
                    uploaded_bytes=result.uploaded_bytes, logical_bytes=result.logical_bytes,
                    seconds=round(result.total_seconds, 3))
            if step_delay:
                time.sleep(step_delay)
        for p in pending:
            result = p.result()
            log("committed", step=result.step, mode=result.mode,
                uploaded_bytes=result.uploaded_bytes, logical_bytes=result.logical_bytes,
                seconds=round(result.total_seconds, 3))
        log("stopped" if stopped else "done", step=last, eval_loss=eval_loss(model))


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # a rank's death shows up here as a gloo error
        print(json.dumps({"event": "error", "error": str(exc).splitlines()[0]}), flush=True)
        sys.exit(1)
    # destroys the process group and exits without interpreter finalization, where torch's
    # gloo threads can abort a finished rank (trainer_sidecar/rank_exit.py)
    exit_rank(0)
