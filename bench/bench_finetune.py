#!/usr/bin/env python3
"""Frozen weights cost nothing: bytes uploaded per checkpoint of a fine-tuning run.

A fine-tuning shape (issue 27): a frozen backbone (per block a d x d weight and a
LayerNorm, and an embedding), with low-rank adapters (LoRA: d x r and r x d per block)
the only trainable parameters, AdamW over those alone; FSDP2 over 2 ranks (gloo, CPU).
Each round trains one step and saves; the bench counts what the save put in the bucket
(every object new since the last save, listed: chunks, DCP metadata and manifests) and
divides it by the bytes that changed, the trainable parameters plus their optimizer
state (two moments and a step each). The same rounds run interleaved in the
``incremental`` and the ``differential`` mode, each at its own URI; the first save of
each is full (it uploads the backbone once).

    python bench/bench_finetune.py --json /tmp/finetune.json    # 512 MiB backbone
    python bench/bench_finetune.py --quick                      # 16 MiB, a smoke run

Ratio: bytes uploaded per checkpoint / trainable state bytes (target <= 1.1), median of
the rounds. Every ``full_every``-th checkpoint (10 by default) is full and uploads the
whole state again; the report says what that adds on average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import bench_checkpoint as bc

WORLD = 2
MODES = ("incremental", "differential")
MIB = 1 << 20
TARGET = 1.1
FULL_EVERY = 10  # CheckpointConfig's default


# --------------------------------------------------------------------------- ranks


def build(d: int, blocks: int, rank: int, vocab: int) -> tuple[Any, Any]:
    """The model, FSDP2-sharded per block, and AdamW over its adapters alone."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(d)
            self.weight = torch.nn.Linear(d, d, bias=False)  # the backbone's: frozen
            self.lora_a = torch.nn.Parameter(torch.randn(rank, d) / d)
            self.lora_b = torch.nn.Parameter(torch.zeros(d, rank))

        def forward(self, x: Any) -> Any:
            h = self.norm(x)
            return x + self.weight(h) + (h @ self.lora_a.T) @ self.lora_b.T

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(1)  # the same backbone on every rank before sharding
    model = Model()
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-3)


def train_step(model: Any, optimizer: Any, step: int, vocab: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (4, 16), generator=gen)
    model(tokens).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def trainable_state_bytes(model: Any) -> int:
    """The trainable parameters and AdamW's state for them: two moments of the same shape
    and a step (a float32 scalar) per parameter, over the whole model (not a shard)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            total += 3 * p.numel() * p.element_size() + 4
    return total


def frozen_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def bucket_objects(client: Any, bucket: str, prefix: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return found


def run_rounds(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from trainer_sidecar import CheckpointConfig, Checkpointer
    from trainer_sidecar.format.manifest import Mode

    d, vocab = args["d"], args["vocab"]
    model, optimizer = build(d, args["blocks"], args["rank"], vocab)
    train_step(model, optimizer, 0, vocab)  # AdamW's state exists from the first step
    client = bc.boto3_client() if dist.get_rank() == 0 else None
    ckpts = {
        mode: Checkpointer(
            CheckpointConfig(uri=f"{args['uri']}/{mode}", mode=Mode(mode), keep_last=0)
        )
        for mode in MODES
    }
    seen: dict[str, dict[str, int]] = {mode: {} for mode in MODES}
    uploaded: dict[str, list[int]] = {mode: [] for mode in MODES}
    reported: dict[str, list[int]] = {mode: [] for mode in MODES}
    first: dict[str, int] = {}
    try:
        for step in range(1, args["rounds"] + 2):
            if step > 1:
                train_step(model, optimizer, step, vocab)
            for mode, ckpt in ckpts.items():  # interleaved: the same state, both modes
                pending = ckpt.save(step, model=model, optimizer=optimizer)
                assert pending is not None
                result = pending.result()
                dist.barrier()  # committed on every rank
                if client is None:
                    continue
                prefix = f"{args['prefix']}/{mode}/"
                now = bucket_objects(client, args["bucket"], prefix)
                new = sum(size for key, size in now.items() if key not in seen[mode])
                seen[mode] = now
                if step == 1:
                    first[mode] = new
                else:
                    uploaded[mode].append(new)
                    reported[mode].append(result.uploaded_bytes)
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    return {
        "uploaded": uploaded,
        "reported": reported,
        "first": first,
        "trainable_state_bytes": trainable_state_bytes(model),
        "frozen_bytes": frozen_bytes(model),
    }


def worker_main(phase: str, args_path: str) -> None:
    bc.rank_main({"rounds": run_rounds}, phase, args_path)


# --------------------------------------------------------------------------- the driver


def run(opts: argparse.Namespace) -> dict[str, Any]:
    d = opts.d
    blocks = max(1, round(opts.backbone_mib * MIB / (d * d * 4)))
    with bc.s3_server(opts.endpoint_url, opts.s3) as (endpoint, server, _):
        env = bc.project_env(endpoint)
        bucket = bc.create_bucket(endpoint)
        args = {"d": d, "blocks": blocks, "rank": opts.lora_rank, "vocab": opts.vocab,
                "rounds": opts.rounds, "bucket": bucket, "prefix": "finetune",
                "uri": f"s3://{bucket}/finetune"}  # fmt: skip
        bc.log(f"{blocks} blocks of {d} x {d}, LoRA rank {opts.lora_rank}, {WORLD} ranks; "
               f"{opts.rounds} rounds; {server}")  # fmt: skip
        measured = bc.run_world(WORLD, "rounds", args, env, script=__file__)
    trainable = measured["trainable_state_bytes"]
    modes = {}
    ratios, targets = {}, {}
    for mode in MODES:
        per = measured["uploaded"][mode]
        median = statistics.median(per)
        full = measured["first"][mode]
        modes[mode] = {
            "first_save_bytes": full,
            "uploaded_bytes": per,
            "reported_uploaded_bytes": measured["reported"][mode],
            "median_bytes": median,
            # with a full checkpoint every FULL_EVERY-th (the default), on average
            "mean_with_periodic_full_bytes": (full + (FULL_EVERY - 1) * median) / FULL_EVERY,
        }
        name = f"{mode}_bytes_per_checkpoint_vs_trainable_state"
        ratios[name] = median / trainable
        targets[name] = {"target": f"<= {TARGET}", "met": ratios[name] <= TARGET}
        ratios[f"{mode}_with_a_full_every_{FULL_EVERY}_vs_trainable_state"] = (
            modes[mode]["mean_with_periodic_full_bytes"] / trainable
        )
    return {
        "command": " ".join(["python", "bench/bench_finetune.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "d": d,
            "blocks": blocks,
            "lora_rank": opts.lora_rank,
            "vocab": opts.vocab,
            "rounds": opts.rounds,
            "world_size": WORLD,
            "quick": opts.quick,
        },  # fmt: skip
        "server": server,
        "machine": bc.machine(),
        "frozen_bytes": measured["frozen_bytes"],
        "trainable_state_bytes": trainable,
        "modes": modes,
        "ratios": ratios,
        "targets": targets,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"frozen {report['frozen_bytes'] / MIB:.1f} MiB; trainable parameters + AdamW state "
        f"{report['trainable_state_bytes'] / MIB:.2f} MiB; {report['server']}",
        f"{'mode':<14}{'first save MiB':>16}{'per checkpoint MiB (each round)':>34}",
        "-" * 64,
    ]
    for mode, m in report["modes"].items():
        rounds = " ".join(f"{b / MIB:.2f}" for b in m["uploaded_bytes"])
        lines.append(f"{mode:<14}{m['first_save_bytes'] / MIB:>16.1f}    {rounds}")
    lines += bc.ratio_lines(report, width=58)
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures and ratios here")
    parser.add_argument("--quick", action="store_true", help="16 MiB backbone, 2 rounds")
    parser.add_argument("--backbone-mib", type=int, default=512, help="frozen d x d weights")
    parser.add_argument("--d", type=int, default=1024, help="the model's width")
    parser.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--vocab", type=int, default=8192, help="the embedding's rows")
    parser.add_argument("--rounds", type=int, default=5, help="checkpoints measured per mode")
    bc.add_s3_arguments(parser)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.backbone_mib, opts.d, opts.vocab, opts.rounds = 16, 512, 1024, 2
    return opts


def main(argv: list[str] | None = None) -> int:
    return bc.script_main(argv, parse_args=parse_args, run=run, table=table)


if __name__ == "__main__":
    sys.exit(main())
