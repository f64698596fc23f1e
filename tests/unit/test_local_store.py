from __future__ import annotations

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
