"""An object store in memory: for tests and benchmarks of what sits above the store
(commit, persister, gc, the format at scale), where a real server would only add noise."""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterable, Iterator

from ..errors import ObjectExists, ObjectNotFound
from .base import ObjectInfo


class MemoryStore:
    """The four-method store in a dict, with a settable clock and create-only puts."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, float]] = {}
        self.now = 1_000_000.0
        self.puts: list[str] = []
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        with self._lock:
            if if_absent and key in self.objects:
                raise ObjectExists(key)
            self.objects[key] = (bytes(data), self.now)
            self.puts.append(key)

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        with self._lock:
            if key not in self.objects:
                raise ObjectNotFound(key)
            data = self.objects[key][0]
        return data if byte_range is None else data[byte_range[0] : byte_range[1]]

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        with self._lock:
            found = sorted((k, v) for k, v in self.objects.items() if k.startswith(prefix))
        for key, (data, when) in found:
            yield ObjectInfo(key, len(data), when)

    def delete(self, keys: Iterable[str]) -> None:
        doomed = list(keys)  # may be a generator over list(): drain it before locking
        with self._lock:
            for key in doomed:
                self.objects.pop(key, None)

    def keys(self, prefix: str = "") -> builtins.list[str]:
        return [o.key for o in self.list(prefix)]
