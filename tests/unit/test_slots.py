"""The staging root is private and one process stages a rank; a full volume is an error."""

from __future__ import annotations

import errno
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.errors import CheckpointError
from trainer_sidecar.save import slots, staging


def test_the_staging_root_is_created_private(tmp_path: Path) -> None:
    root = slots.prepare_root(tmp_path / "stage" / "job")
    assert root.stat().st_mode & 0o777 == 0o700


def test_a_too_open_root_of_ours_is_tightened(tmp_path: Path) -> None:
    root = tmp_path / "job"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    slots.prepare_root(root)
    assert root.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_root_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "job"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)  # nobody
    with pytest.raises(CheckpointError, match="belongs to uid 65534, not to this process"):
        slots.prepare_root(root)


def test_a_symlink_in_place_of_the_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "job").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="is not a directory"):
        slots.prepare_root(tmp_path / "job")


def test_two_locks_on_one_rank_exclude_each_other_until_released(tmp_path: Path) -> None:
    first, second = slots.RankLock(tmp_path, 3), slots.RankLock(tmp_path, 3)
    first.acquire()
    held_by_us = f"rank 3 is already staging .* \\(pid {os.getpid()}\\)"
    with pytest.raises(CheckpointError, match=held_by_us):
        second.acquire()
    slots.RankLock(tmp_path, 4).acquire()  # another rank is free
    first.release()
    second.acquire()
    second.release()


def test_a_lock_held_by_another_process_refuses_and_dies_with_it(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from trainer_sidecar.save.slots import RankLock;"
            f"RankLock(pathlib.Path({str(tmp_path)!r}), 0).acquire(); print('held', flush=True);"
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(CheckpointError, match=f"pid {holder.pid}"):
            slots.RankLock(tmp_path, 0).acquire()
    finally:
        holder.kill()  # kill -9 releases it: a restarted trainer never waits
        holder.wait()
    slots.RankLock(tmp_path, 0).acquire()


def test_two_checkpointers_cannot_stage_one_rank(tmp_path: Path) -> None:
    config = CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(tmp_path / "s"))
    model = torch.nn.Linear(4, 4)
    with Checkpointer(config) as first:
        first.save(1, model=model).result()  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match="rank 0 is already staging"):
            Checkpointer(config).save(2, model=model)
    with Checkpointer(config) as again:  # closed: free again
        again.save(3, model=model).result()  # type: ignore[union-attr]


def test_a_full_staging_volume_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(CheckpointError, match="staging volume has no room for 4,096 bytes"):
        staging.mapped(tmp_path / "slot" / "__0_0.distcp").ensure(4096)


def tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    return done.returncode == 0


def test_a_save_into_a_real_full_tmpfs_fails_cleanly(tmp_path: Path) -> None:
    """The real thing where the machine lets us mount one (root): no SIGBUS, an error."""
    small = tmp_path / "tmpfs"
    if os.geteuid() != 0 or not tmpfs(small, "1m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        config = CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(small))
        with Checkpointer(config) as ckpt:
            with pytest.raises(CheckpointError, match="no room"):
                ckpt.save(1, model=torch.nn.Linear(1024, 1024))  # 4 MiB into 1 MiB
            assert ckpt.save(2, model=torch.nn.Linear(64, 64)) is not None  # fits: saves
    finally:
        subprocess.run(["umount", str(small)])


def test_observations_relayed_to_the_sidecar_are_taken_once(tmp_path: Path) -> None:
    slots.relay_observation(tmp_path, 0, "stall", 0.25)
    slots.relay_observation(tmp_path, 1, "failure", 1.0, "restore")
    (tmp_path / slots.OBSERVED_DIR / "2-1-0.json").write_text('{"name": "exec", "value": 1}')
    (tmp_path / slots.OBSERVED_DIR / "2-2-0.json").write_text("not json")
    (tmp_path / slots.OBSERVED_DIR / "2-3-0.json").write_text('{"name": "stall", "value": -1}')
    # the rank becomes a label value: never an unbounded or non-integer one
    for i, rank in enumerate(('"1"', "-1", str(slots.MAX_RANKS), "1.5")):
        (tmp_path / slots.OBSERVED_DIR / f"3-{i}-0.json").write_text(
            f'{{"name": "stall", "value": 1, "rank": {rank}}}'
        )
    taken = slots.take_observations(tmp_path)
    assert sorted(taken) == [("failure", 1.0, "restore", 1), ("stall", 0.25, "", 0)]
    assert slots.take_observations(tmp_path) == []  # read once, every file removed
    assert list((tmp_path / slots.OBSERVED_DIR).iterdir()) == []
    slots.relay_observation(tmp_path / "missing" / "root", 0, "stall", 1.0)  # best effort


def test_a_trainer_in_sidecar_mode_relays_what_it_observes(tmp_path: Path) -> None:
    from trainer_sidecar.metrics import CheckpointMetrics

    # two trainers of one pod (nprocPerNode 2), ranks 2 and 3, and their one sidecar
    two, three, sidecar = CheckpointMetrics(), CheckpointMetrics(), CheckpointMetrics()
    two.relay = functools.partial(slots.relay_observation, tmp_path, 2)
    three.relay = functools.partial(slots.relay_observation, tmp_path, 3)
    two.observe_stall(0.5, 2)
    three.observe_stall(0.75, 3)
    two.observe_restore(2.0, 2)
    two.count_failure("stage")
    two.count_skipped()
    for observation in slots.take_observations(tmp_path):
        sidecar.apply(*observation)
    r = sidecar.registry
    assert r.get_sample_value("ctj_checkpoint_stall_seconds_sum", {"rank": "2"}) == 0.5
    assert r.get_sample_value("ctj_checkpoint_stall_seconds_sum", {"rank": "3"}) == 0.75
    assert r.get_sample_value("ctj_checkpoint_restore_seconds_sum", {"rank": "2"}) == 2.0
    assert r.get_sample_value("ctj_checkpoint_failures_total", {"stage": "stage"}) == 1
    assert r.get_sample_value("ctj_checkpoint_skipped_total") == 1


def test_pending_tolerates_a_rank_directory_removed_while_it_scans(tmp_path: Path) -> None:
    """A trainer's close() removes its rank's directory while the sidecar polls: the scan
    sees nothing there, never a FileNotFoundError that ends the sidecar (as pathlib's glob
    raised, 1 trial in 20 of the chaos test)."""
    import threading

    (tmp_path / "rank-0" / "slot-0").mkdir(parents=True)
    stop = threading.Event()

    def churn() -> None:  # rank 1's directory comes and goes, as trainers start and close
        while not stop.is_set():
            (tmp_path / "rank-1" / "slot-0").mkdir(parents=True, exist_ok=True)
            (tmp_path / "rank-1" / "slot-0").rmdir()
            (tmp_path / "rank-1").rmdir()

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(3000):
            assert slots.pending(tmp_path) == []
            assert slots.pending(tmp_path, 1) == []
    finally:
        stop.set()
        thread.join()
    (tmp_path / "rank-3").write_text("a file where a directory was")
    assert slots.pending(tmp_path) == []
