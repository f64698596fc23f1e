"""A minimal list-then-watch cache, the part of client-go's informer we need.

The DNS publisher and the node agents both keep a local copy of some objects and react to
changes. A bare ``watch.stream`` loop silently loses events when the server closes the
watch or the resourceVersion expires (410 Gone); this class relists in both cases and
keeps watches short (``timeout_seconds``), so a stalled connection cannot go unnoticed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import watch
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)
Obj = dict[str, Any]


class Informer:
    """Keeps ``store`` (uid -> object as a dict) in sync with ``list_fn(**kwargs)`` and calls
    ``on_event(type, obj)`` after each change (type: ADDED, MODIFIED, DELETED; a relist
    reports what it finds as ADDED and what vanished as DELETED)."""

    def __init__(
        self,
        api: ApiClient,
        list_fn: Callable[..., Any],
        on_event: Callable[[str, Obj], None],
        *,
        name: str,
        watch_timeout: int = 30,
        **kwargs: Any,
    ) -> None:
        self._api = api
        self._list_fn = list_fn
        self._on_event = on_event
        self._kwargs = kwargs
        self._watch_timeout = watch_timeout
        self.name = name
        self.store: dict[str, Obj] = {}
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _relist(self) -> str:
        result = self._list_fn(_preload_content=False, **self._kwargs)
        body = json.loads(result.data)
        seen: dict[str, Obj] = {}
        for item in body.get("items") or []:
            seen[item["metadata"]["uid"]] = item
        for uid in set(self.store) - set(seen):
            gone = self.store.pop(uid)
            self._on_event("DELETED", gone)
        for uid, item in seen.items():
            self.store[uid] = item
            self._on_event("ADDED", item)
        self.synced.set()
        return str(body["metadata"]["resourceVersion"])

    def _run(self) -> None:
        resource_version = ""
        while not self._stop.is_set():
            try:
                if not resource_version:
                    resource_version = self._relist()
                self._watch = watch.Watch()
                for event in self._watch.stream(
                    self._list_fn,
                    resource_version=resource_version,
                    timeout_seconds=self._watch_timeout,
                    allow_watch_bookmarks=True,
                    _request_timeout=self._watch_timeout + 10,
                    **self._kwargs,
                ):
                    kind, raw = event["type"], event["raw_object"]
                    if kind == "ERROR":
                        resource_version = ""  # expired (410): relist
                        break
                    resource_version = raw["metadata"]["resourceVersion"]
                    if kind == "BOOKMARK":
                        continue
                    uid = raw["metadata"]["uid"]
                    if kind == "DELETED":
                        self.store.pop(uid, None)
                    else:
                        self.store[uid] = raw
                    self._on_event(kind, raw)
                    if self._stop.is_set():
                        break
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = ""
                    continue
                log.warning("%s: watch failed (%s); retrying", self.name, exc.reason)
                time.sleep(0.5)
            except Exception as exc:  # connection reset, server restart: relist and go on
                if self._stop.is_set():
                    return
                log.warning("%s: watch error %r; relisting", self.name, exc)
                resource_version = ""
                time.sleep(0.5)
