"""Removing a deleted job's data from the node: which directories go, and the loop that does it.

Every ``period_s`` the agent lists the CheckpointedTrainingJobs it may see (their uids
only: a metadata-only list) and removes each job directory whose uid is not among them.
A job deleted is so gone from the node within about one period plus one list.

Race-safe with a job just created: a directory is made only when one of the job's pods
first writes, which is after the job exists. A list that began at ``started`` (a quorum
read: it sees every job created before it began) and lacks a directory's uid proves the
job gone only if the directory was made before ``started``; a younger one waits for the
next list (``MARGIN_S`` more for coarse file times). A list that fails removes nothing.
Where the agent sees only some namespaces (a namespaced install), directories of others
are never touched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from ctj_contract import GROUP, PLURAL, VERSION

from .store import JobKey, NodeStore, now

log = logging.getLogger(__name__)

MARGIN_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class Listing:
    """The live jobs as one list saw them."""

    uids: frozenset[str]
    started: float
    """Wall clock when the list began: every job created before then is in ``uids``."""
    namespaces: frozenset[str] | None = None
    """The namespaces listed; None: all of them."""


def stale_jobs(
    jobs: Iterable[tuple[JobKey, float]], listing: Listing, margin_s: float = MARGIN_S
) -> list[JobKey]:
    """Which job directories (job, when its directory was made) belong to no live job."""
    return sorted(
        job
        for job, created in jobs
        if (listing.namespaces is None or job.namespace in listing.namespaces)
        and job.uid not in listing.uids
        and created < listing.started - margin_s
    )


class JobLister(Protocol):
    def list(self) -> Listing:
        """The live jobs; raises on any failure (then nothing is removed)."""
        ...


SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PARTIAL = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"


class KubeJobLister:
    """Lists CheckpointedTrainingJobs' uids from the API server with the pod's service
    account (stdlib only: the agent's image has no Kubernetes client), metadata only,
    paginated, each request within ``timeout_s``."""

    def __init__(
        self,
        server: str,
        *,
        namespaces: Iterable[str] = (),
        sa_dir: Path = SA_DIR,
        timeout_s: float = 10.0,
        page: int = 500,
    ) -> None:
        self.server = server.rstrip("/")
        self.namespaces = frozenset(namespaces) or None
        self.sa_dir, self.timeout_s, self.page = sa_dir, timeout_s, page
        self._ssl = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))

    def list(self) -> Listing:
        started = now()
        uids: set[str] = set()
        prefixes = (
            [f"/apis/{GROUP}/{VERSION}/{PLURAL}"]
            if self.namespaces is None
            else [f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}" for ns in self.namespaces]
        )
        for prefix in prefixes:
            cont = ""
            while True:
                query = {"limit": str(self.page)} | ({"continue": cont} if cont else {})
                body = self._get(f"{prefix}?{urllib.parse.urlencode(query)}")
                for item in body.get("items") or []:
                    uids.add(str(item["metadata"]["uid"]))
                cont = (body.get("metadata") or {}).get("continue") or ""
                if not cont:
                    break
        return Listing(frozenset(uids), started, self.namespaces)

    def _get(self, path: str) -> dict[str, Any]:
        token = (self.sa_dir / "token").read_text().strip()  # re-read: bound tokens rotate
        request = urllib.request.Request(
            self.server + path,
            headers={"Authorization": f"Bearer {token}", "Accept": PARTIAL},
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._ssl) as r:
            found = json.loads(r.read(64 << 20))  # a page of metadata: far below this
        if not isinstance(found, dict):
            raise ValueError("the API server's answer is not a JSON object")
        return found


class FileJobLister:
    """The live jobs from a JSON file ``{"uids": [...]}`` (tests, and nodes run without
    Kubernetes): read afresh each round; a missing or malformed file is a failed list."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def list(self) -> Listing:
        started = now()
        uids = json.loads(self.path.read_text())["uids"]
        if not isinstance(uids, list) or not all(isinstance(u, str) for u in uids):
            raise ValueError(f"{self.path}: uids is not a list of strings")
        return Listing(frozenset(uids), started)


class Collector:
    """Every ``period_s``: list the live jobs, remove the stale directories (a thread)."""

    def __init__(
        self,
        store: NodeStore,
        lister: JobLister,
        *,
        period_s: float,
        on_removed: Callable[[JobKey, int], None] | None = None,
    ) -> None:
        if period_s <= 0:
            raise ValueError("the collection period must be > 0 seconds")
        self.store, self.lister, self.period_s = store, lister, period_s
        self.on_removed = on_removed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ctj-agent-gc", daemon=True)

    def start(self) -> Collector:
        self._thread.start()
        return self

    def collect(self) -> list[JobKey]:
        """One round; the jobs removed."""
        try:
            listing = self.lister.list()
        except Exception as exc:  # noqa: BLE001 - nothing removed; the next round retries
            log.warning("cannot list the CheckpointedTrainingJobs (%s): removing nothing", exc)
            return []
        stale = stale_jobs(((j, self.store.created(j)) for j in self.store.jobs()), listing)
        for job in stale:
            freed = self.store.remove_job(job)
            log.info("job %s is gone: removed its node cache (%d bytes)", job.relative, freed)
            if self.on_removed is not None:
                self.on_removed(job, freed)
        return stale

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.collect()
            self._stop.wait(max(self.period_s - (time.monotonic() - began), 0.0))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.period_s + 15)
