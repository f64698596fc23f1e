"""The sidecar as a separate process: it commits what the trainer staged, whatever happens
to the trainer; SIGTERM and kill -9 never leave a half-written checkpoint visible."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, promtool_check
from tests.integration.ranks import run_ranks, spawn_ranks
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.store import repository as repo

pytestmark = pytest.mark.integration


def wait_until(condition: Callable[[], object], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Sidecar:
    """`ctj sidecar` in its own process, its log in a file the test can watch."""

    def __init__(self, uri: str, staging: Path, log: Path, *, grace: float = 30) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainer_sidecar",
                "sidecar",
                "--uri",
                uri,
                "--staging-dir",
                str(staging),
                "--metrics-port",
                "0",
                "--grace",
                str(grace),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(log, "a"),  # noqa: SIM115
            env=dict(
                os.environ, CTJ_CHECKPOINT_PARALLELISM="1", CTJ_CHECKPOINT_CHUNK_SIZE=str(1 << 20)
            ),
        )
        wait_until(lambda: "serving /metrics" in self.text(), "the sidecar to start", 60)
        self.port = int(re.findall(r"on port (\d+)", self.text())[-1])
        wait_until(lambda: self.get("/readyz")[0] == 200, "sidecar readiness", 60)

    def text(self) -> str:
        return self.log.read_text()

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except OSError:
            return 0, ""

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout)

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def sidecars() -> Iterator[list[Sidecar]]:
    started: list[Sidecar] = []
    yield started
    for s in started:
        s.__exit__()


def big_model(seed: int = 0) -> torch.nn.Module:
    """64 MiB of fp32: at one 1 MiB chunk at a time the upload takes a while on moto."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])


def sidecar_config(uri: str, staging: Path) -> CheckpointConfig:
    return CheckpointConfig(uri=uri, sidecar=True, staging_dir=str(staging))


def test_trainer_killed_right_after_save_returns_still_commits(
    s3_uri: str, tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    staging = tmp_path / "staging"
    sidecars.append(Sidecar(s3_uri, staging, tmp_path / "sidecar.log"))
    args = {
        "kind": "fsdp",
        "uri": s3_uri,
        "step": 4,
        "ref": str(tmp_path / "ref.pt"),
        "marker": str(tmp_path / "staged"),
        "config": {"sidecar": True, "staging_dir": str(staging)},
    }
    procs = spawn_ranks(2, "tests.integration.workers:save_and_freeze", args)

    def staged() -> bool:
        for rank, p in enumerate(procs):  # a rank that ended early fails now, with its output
            assert p.poll() is None, f"rank {rank} exited {p.returncode}:\n{p.communicate()[0]}"
        return all(Path(f"{args['marker']}.{r}").exists() for r in (0, 1))

    wait_until(staged, "both ranks to stage")
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(30)
    try:
        wait_until(
            lambda: repo.committed_steps(Checkpointer(CheckpointConfig(uri=s3_uri)).store) == [4],
            "the sidecar to commit step 4",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the sidecar's log:\n{sidecars[0].text()[-3000:]}") from None
    text = sidecars[0].get("/metrics")[1]
    for rank in (0, 1):  # one sidecar persisted both ranks of its pod, a series for each
        series = rf'^ctj_checkpoint_upload_seconds_count\{{rank="{rank}"\}} 1\.0$'
        assert re.search(series, text, re.M), text
    args["config"] = {}
    run_ranks(3, "tests.integration.workers:load_and_compare", args)


def test_sigterm_during_upload_finishes_and_commits(
    s3_uri: str, tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    staging = tmp_path / "staging"
    sidecar = Sidecar(s3_uri, staging, tmp_path / "sidecar.log", grace=60)
    sidecars.append(sidecar)
    model = big_model()
    trainer = Checkpointer(sidecar_config(s3_uri, staging))
    trainer.save(1, model=model)
    wait_until(lambda: "uploading step 1" in sidecar.text(), "the upload to start")
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait() == 0, sidecar.text()
    log = sidecar.text()
    assert log.index("got SIGTERM") < log.index("committed step 1") < log.index("exiting")
    fresh = big_model(seed=1)
    loaded = Checkpointer(CheckpointConfig(uri=s3_uri)).load(model=fresh)
    assert loaded is not None and loaded.step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    trainer.close()  # step 1 is committed: found at once (not at exit, the store gone)


def test_a_failed_loop_does_not_wait_for_its_last_commit_and_the_sidecar_makes_it(
    s3_uri: str, tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    """A peer's death surfaces in the loop as an exception from a collective: leaving the
    ``with`` block then does not wait out the shutdown grace for a commit that may never
    come (a plain close() would: nothing commits while no sidecar runs), and nothing is
    dropped: the staged save stays for the sidecar, which commits it."""
    staging = tmp_path / "staging"
    grace = 60.0
    config = CheckpointConfig(
        uri=s3_uri, sidecar=True, staging_dir=str(staging), shutdown_grace_s=grace
    )
    model = big_model()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="peer"), Checkpointer(config) as ckpt:
        ckpt.save(1, model=model)
        raise RuntimeError("the peer is gone")
    assert time.monotonic() - started < grace / 2, "close() waited for the commit"
    sidecars.append(Sidecar(s3_uri, staging, tmp_path / "sidecar.log"))
    fresh = big_model(seed=1)
    wait_until(
        lambda: repo.committed_steps(Checkpointer(CheckpointConfig(uri=s3_uri)).store) == [1],
        "the sidecar to commit step 1",
    )
    loaded = Checkpointer(CheckpointConfig(uri=s3_uri)).load(model=fresh)
    assert loaded is not None and loaded.step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_sigterm_with_too_short_a_grace_commits_nothing(
    s3_uri: str, tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    staging = tmp_path / "staging"
    sidecar = Sidecar(s3_uri, staging, tmp_path / "sidecar.log", grace=0)
    sidecars.append(sidecar)
    trainer = Checkpointer(sidecar_config(s3_uri, staging))
    trainer.save(1, model=big_model())
    wait_until(lambda: "uploading step 1" in sidecar.text(), "the upload to start")
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait() == 1, sidecar.text()  # 1: it says it left work staged
    assert "staged but not committed" in sidecar.text()
    store = Checkpointer(CheckpointConfig(uri=s3_uri)).store
    assert repo.committed_steps(store) == []
    assert Checkpointer(CheckpointConfig(uri=s3_uri)).load(model=big_model(2)) is None
    trainer.close(wait_for_commit=False)  # step 1 never commits: not waited for at exit


def test_sidecar_killed_mid_upload_previous_stays_latest_next_save_works(
    s3_uri: str, tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    staging = tmp_path / "staging"
    sidecar = Sidecar(s3_uri, staging, tmp_path / "sidecar.log")
    sidecars.append(sidecar)
    trainer = Checkpointer(sidecar_config(s3_uri, staging))
    model = big_model()
    trainer.save(1, model=model).result()
    with torch.no_grad():
        model[0].weight.add_(1)
    trainer.save(2, model=model)
    wait_until(lambda: "uploading step 2" in sidecar.text(), "the upload of step 2")
    sidecar.signal(signal.SIGKILL)
    sidecar.wait()
    assert repo.committed_steps(trainer.store) == [1]
    assert Checkpointer(CheckpointConfig(uri=s3_uri)).load(model=big_model(3)).step == 1

    sidecars.append(Sidecar(s3_uri, staging, tmp_path / "sidecar2.log"))
    with torch.no_grad():
        model[1].weight.add_(1)
    result = trainer.save(3, model=model).result()  # waits for the slot, then commits
    assert result.step == 3
    assert repo.committed_steps(trainer.store)[-1] == 3
    fresh = big_model(4)
    assert Checkpointer(CheckpointConfig(uri=s3_uri)).load(model=fresh).step == 3
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_sidecar_serves_health_and_metrics(
    s3_uri: str, tmp_path: Path, sidecars: list[Sidecar]
) -> None:
    staging = tmp_path / "staging"
    sidecar = Sidecar(s3_uri, staging, tmp_path / "sidecar.log")
    sidecars.append(sidecar)
    trainer = Checkpointer(sidecar_config(s3_uri, staging))
    trainer.save(1, model=torch.nn.Linear(8, 8)).result()  # type: ignore[union-attr]
    assert trainer.load(model=torch.nn.Linear(8, 8)) is not None
    assert sidecar.get("/healthz")[0] == 200
    committed = r"^ctj_checkpoint_commit_seconds_count 1\.0$"  # observed just after the commit
    wait_until(lambda: re.search(committed, sidecar.get("/metrics")[1], re.M), "commit metric")
    # what the trainer observed (it serves no /metrics in sidecar mode), relayed
    relayed = r'^ctj_checkpoint_restore_seconds_count\{rank="0"\} 1\.0$'
    wait_until(lambda: re.search(relayed, sidecar.get("/metrics")[1], re.M), "restore metric")
    status, text = sidecar.get("/metrics")
    assert status == 200
    assert re.search(r'^ctj_checkpoint_stall_seconds_count\{rank="0"\} 1\.0$', text, re.M)
    assert re.search(r"^ctj_staging_capacity_bytes [1-9]", text, re.M)
    assert re.search(r'^ctj_checkpoint_upload_seconds_count\{rank="0"\} 1\.0$', text, re.M)
    assert re.search(r"^ctj_checkpoint_last_committed_step 1\.0$", text, re.M)
    assert re.search(r'^ctj_checkpoint_bytes_total\{kind="uploaded"\} [1-9]', text, re.M)
    check = promtool_check(text)
    assert check.returncode == 0, check.stdout + check.stderr


def test_emergency_checkpoint_on_sigterm(s3_uri: str, tmp_path: Path) -> None:
    args = {"uri": s3_uri}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.ranks",
            "tests.integration.workers:train_until_preempted",
            json.dumps(args),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "step 5":
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(60) == 0
    saved = int(re.search(r"emergency checkpoint at step (\d+)", rest).group(1))  # type: ignore[union-attr]
    assert saved >= 5
    assert repo.committed_steps(Checkpointer(CheckpointConfig(uri=s3_uri)).store) == [saved]
