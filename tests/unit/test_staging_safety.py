"""On a shared host the staging root must be out of other users' reach, the directories
above it included (as ssh's StrictModes checks a home directory), and a slot's
``ready.json`` names only files inside its slot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainer_sidecar.errors import CheckpointError
from trainer_sidecar.format.manifest import SaveIdentity
from trainer_sidecar.format.policy import SavePlan
from trainer_sidecar.save import slots


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_root_below_a_group_or_world_writable_directory_is_refused(
    tmp_path: Path, mode: int
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(CheckpointError) as info:
        slots.prepare_root(shared / "ctj" / "job")
    message = str(info.value)
    assert f"{shared} " in message and "writable by other users" in message, message
    assert "chmod go-w" in message and "CTJ_STAGING_DIR" in message, message
    assert not (shared / "ctj").exists()  # nothing made below it


def test_a_sticky_world_writable_directory_above_is_accepted(tmp_path: Path) -> None:
    """/tmp and /dev/shm: others may add names there, never rename or remove ours."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    root = slots.prepare_root(sticky / "ctj-staging" / "job")
    assert root.stat().st_mode & 0o777 == 0o700
    assert (sticky / "ctj-staging").stat().st_mode & 0o022 == 0


def test_parents_made_for_the_root_are_never_group_writable(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        slots.prepare_root(tmp_path / "a" / "b" / "job")
    finally:
        os.umask(old)
    for made in (tmp_path / "a", tmp_path / "a" / "b"):
        assert made.stat().st_mode & 0o022 == 0, oct(made.stat().st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_directory_above_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"  # e.g. /dev/shm/ctj-staging-<uid>, made first by another
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(CheckpointError, match=f"{theirs} belongs to uid 65534"):
        slots.prepare_root(theirs / "job")


def test_a_pods_own_volume_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kubelet mounts an emptyDir root-owned and 0777 (no sticky bit) for the pod alone:
    in a pod, such a volume's mount point is accepted; anywhere else it is refused."""
    if os.geteuid() != 0:
        pytest.skip("the volume must belong to root")
    volume = tmp_path / "staging"
    volume.mkdir()
    os.chmod(volume, 0o777)
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == volume or real_ismount(p))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(CheckpointError, match="writable by other users"):
        slots.prepare_root(volume / "job")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert slots.prepare_root(volume / "job").is_dir()
    (volume / "sub").mkdir()
    os.chmod(volume / "sub", 0o777)  # not a mount point: refused in a pod too
    with pytest.raises(CheckpointError, match="writable by other users"):
        slots.prepare_root(volume / "sub" / "job")


def staged_json(files: list[list[object]]) -> str:
    plan = SavePlan(1, "full", None, 1, 0, None, SaveIdentity("0", "0123456789abcdef"))  # type: ignore[arg-type]
    return json.dumps(
        {
            "step": 1,
            "rank": 0,
            "world_size": 1,
            "plan": plan.to_json(),
            "files": files,
            "staged_at": 0.0,
            "stage_seconds": 0.0,
        }
    )


@pytest.mark.parametrize(
    "name", ["../../etc/x", "/etc/passwd", "..", ".", "", "a/b", "a\\b", "x\0y", "x\ny"]
)
def test_a_ready_file_naming_a_path_outside_its_slot_is_refused(
    tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="not a plain file name"):
        slots.StagedCheckpoint.from_json(staged_json([[name, [[0, 8]]]]))
    root = tmp_path / "root"
    slot = root / "rank-0" / "slot-0"
    slot.mkdir(parents=True)
    (slot / slots.READY).write_text(staged_json([["__0_0.distcp", [[0, 8]]], [name, []]]))
    assert slots.pending(root) == []  # never handed to the persister
    assert slots.pending(root) == []
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1 and str(slot / slots.READY) in said[0], said  # said once


def test_a_ready_file_naming_plain_files_is_read() -> None:
    staged = slots.StagedCheckpoint.from_json(
        staged_json([["__0_0.distcp", [[0, 8, "float32"]]], [".metadata", []]])
    )
    assert [n for n, _ in staged.files] == ["__0_0.distcp", ".metadata"]
