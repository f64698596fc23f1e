"""Incremental and differential saves upload only what changed; every checkpoint restores."""

from __future__ import annotations

import boto3
import pytest
import torch

from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.load.verify import verify
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.base import Location

pytestmark = pytest.mark.integration
LAYERS = 20


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(LAYERS)])


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def change_tenth(model: torch.nn.Module, round_: int) -> None:
    """Change 2 of the 20 weight matrices (10% of the bytes), a different pair each round."""
    with torch.no_grad():
        for i in (2 * round_ % LAYERS, (2 * round_ + 1) % LAYERS):
            model[i].weight.add_(1.0)


def chunk_bytes(uri: str, endpoint: str) -> dict[str, int]:
    """Every chunk object in the bucket (the cross-check of the engine's counters)."""
    loc = Location.parse(uri)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=loc.bucket, Prefix=f"{loc.prefix}/chunks/"
    ):
        out.update({o["Key"][len(loc.prefix) + 1 :]: o["Size"] for o in page.get("Contents", [])})
    return out


@pytest.mark.parametrize("mode", ["incremental", "differential"])
def test_chain_of_five_uploads_deltas_and_restores_bitwise(
    mode: str, s3_uri: str, s3_env: dict[str, str]
) -> None:
    config = CheckpointConfig(uri=s3_uri, mode=mode, full_every=100, keep_last=0)
    ckpt = Checkpointer(config)
    model = make_model(0)
    states, results = {}, {}
    for step in range(1, 6):
        if step > 1:
            change_tenth(model, step)
        before = chunk_bytes(s3_uri, s3_env["AWS_ENDPOINT_URL"])
        results[step] = ckpt.save(step, model=model, extra={"step": step}).result()
        after = chunk_bytes(s3_uri, s3_env["AWS_ENDPOINT_URL"])
        new_bytes = sum(size for key, size in after.items() if key not in before)
        states[step] = snapshot(model)
        if step > 1:  # the engine's counter, cross-checked against the bucket itself
            this = repo.read_manifest(ckpt.store, step)
            reference = repo.read_manifest(ckpt.store, 1 if mode == "differential" else step - 1)
            sent = this.chunk_keys() - reference.chunk_keys()
            assert sum(after[k] for k in sent) == results[step].uploaded_bytes
            if mode == "incremental":  # every chunk it sent is new to the bucket
                assert new_bytes == results[step].uploaded_bytes, (step, new_bytes)

    full = results[1]
    assert full.mode == "full" and full.uploaded_bytes == full.logical_bytes
    for step in range(2, 6):
        fraction = results[step].uploaded_bytes / full.logical_bytes
        changed_rounds = 1 if mode == "incremental" else step - 1  # vs parent / vs base
        assert results[step].mode == mode
        assert fraction <= 0.10 * changed_rounds + 0.02, (step, fraction)
    assert results[2].uploaded_bytes <= 0.12 * full.logical_bytes

    for step in range(1, 6):
        fresh = make_model(99)
        extra = {"step": -1}
        loaded = Checkpointer(config).load(model=fresh, extra=extra, step=step)
        assert loaded is not None and loaded.step == step and extra["step"] == step
        for name, want in states[step].items():
            assert torch.equal(fresh.state_dict()[name], want), (step, name)

    # deleting a middle checkpoint and collecting garbage leaves every other one restorable
    store = ckpt.store
    repo.remove(store, [3])
    report = repo.collect_garbage(store, grace_s=0)
    assert report.deleted_chunks > 0 or mode == "differential"
    for step in (1, 2, 4, 5):
        assert not verify(store, repo.read_manifest(store, step))
        fresh = make_model(99)
        assert Checkpointer(config).load(model=fresh, step=step).step == step
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in states[step].items())


def test_retention_keeps_last_k_and_their_base(s3_uri: str, s3_env: dict[str, str]) -> None:
    config = CheckpointConfig(
        uri=s3_uri, mode="differential", full_every=100, keep_last=2, gc_grace_s=0
    )
    ckpt = Checkpointer(config)
    model = make_model(0)
    for step in range(1, 5):
        change_tenth(model, step)
        ckpt.save(step, model=model).result()
    ckpt.close()  # retention runs right after each commit; close() waits for it
    assert repo.committed_steps(ckpt.store) == [1, 3, 4]  # 1 is the base of 3 and 4
    fresh = make_model(5)
    assert Checkpointer(config).load(model=fresh).step == 4
