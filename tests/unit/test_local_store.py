from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from trainer_sidecar.errors import ObjectExists, ObjectNotFound
from trainer_sidecar.store.local import LocalStore


def test_put_get_list_delete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b/c", b"hello")
    store.put("a/x", b"0123456789")
    assert store.get("a/b/c") == b"hello"
    assert store.get("a/x", byte_range=(2, 5)) == b"234"
    assert [o.key for o in store.list("a/")] == ["a/b/c", "a/x"]
    assert [o.key for o in store.list("a/b")] == ["a/b/c"]
    store.delete(["a/b/c", "missing"])
    with pytest.raises(ObjectNotFound):
        store.get("a/b/c")


def test_create_only_put_never_overwrites(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("m", b"first", if_absent=True)
    with pytest.raises(ObjectExists):
        store.put("m", b"second", if_absent=True)
    assert store.get("m") == b"first"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


class _DiskLog:
    """Records what reaches the disk, in order: each fsync (of a file or of a directory,
    by inode) and each rename or link that publishes a name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, int]] = []
        real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

        def fsync(fd: int) -> None:
            info = os.fstat(fd)
            kind = "fsync-dir" if stat.S_ISDIR(info.st_mode) else "fsync-file"
            self.events.append((kind, info.st_ino))
            real_fsync(fd)

        def link(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            self.events.append(("publish", os.stat(src).st_ino))
            real_link(src, dst)

        def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            self.events.append(("publish", os.stat(src).st_ino))
            real_replace(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "link", link)
        monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("if_absent", [False, True], ids=["put", "commit"])
def test_a_put_is_durable_when_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, if_absent: bool
) -> None:
    """The file's data, then (after the name is published) the directory naming it, and the
    parent of every directory the put created: all synced before put() returns."""
    store = LocalStore(tmp_path / "store")
    disk = _DiskLog(monkeypatch)
    store.put("manifests/00000000000000000001.json", b"{}", if_absent=if_absent)
    root = tmp_path / "store"
    data, folder = root / "manifests/00000000000000000001.json", root / "manifests"
    ino = data.stat().st_ino
    assert ("fsync-dir", root.stat().st_ino) in disk.events  # manifests/ was created
    assert disk.events.index(("fsync-dir", root.stat().st_ino)) < disk.events.index(
        ("publish", ino)
    )
    mine = [e for e in disk.events if e[1] in (ino, folder.stat().st_ino)]
    assert mine == [("fsync-file", ino), ("publish", ino), ("fsync-dir", folder.stat().st_ino)]

    disk.events.clear()  # the directory exists now: only the file and its directory
    store.put("manifests/00000000000000000002.json", b"{}", if_absent=if_absent)
    ino = (folder / "00000000000000000002.json").stat().st_ino
    assert disk.events == [
        ("fsync-file", ino),
        ("publish", ino),
        ("fsync-dir", folder.stat().st_ino),
    ]


def test_a_new_store_directory_and_its_new_parents_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _DiskLog(monkeypatch)
    LocalStore(tmp_path / "a" / "b")
    assert disk.events == [
        ("fsync-dir", tmp_path.stat().st_ino),
        ("fsync-dir", (tmp_path / "a").stat().st_ino),
    ]


def test_a_delete_is_durable_when_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path)
    store.put("retired/x", b"1")
    store.put("manifests/x", b"1")
    disk = _DiskLog(monkeypatch)
    store.delete(["manifests/x", "missing/y"])
    assert disk.events == [("fsync-dir", (tmp_path / "manifests").stat().st_ino)]
