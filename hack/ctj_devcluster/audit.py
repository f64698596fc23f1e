"""Reading the API server's audit log: which requests a benchmark made, counted.

With ``ClusterConfig(audit_log=True)`` the API server writes one JSON event per line to
``Cluster.audit_log_path`` for every request (level Metadata: who, what, which object,
the response code; no bodies), at stage ResponseComplete; long-running requests (watch,
exec, follow logs) also get a ResponseStarted event when they start. Nothing here talks
to a cluster: it parses, filters and counts.

The log is written in blocking mode, by the request's own handler as it finishes, so an
event is on disk by the time its (small) response reaches the client; a large response or
a watch's end may be seen by the client a moment before its event is written, so wait
briefly for the counts a test expects rather than reading once.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["AuditEvent", "count", "read_events"]


def _time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value) if value else None


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One audit event (one stage of one request)."""

    audit_id: str
    stage: str
    """ResponseComplete; ResponseStarted (long-running requests); Panic."""
    verb: str
    """The Kubernetes verb (get, list, watch, create, update, patch, delete, ...), or the
    lowercased HTTP method for a non-resource request."""
    resource: str
    """e.g. "configmaps"; "" for a non-resource request (/version, /readyz)."""
    subresource: str
    api_group: str
    """"" for the core group."""
    namespace: str
    name: str
    user: str
    groups: tuple[str, ...]
    user_agent: str
    response_code: int | None
    request_uri: str
    request_received: dt.datetime | None
    stage_timestamp: dt.datetime | None

    @property
    def path(self) -> str:
        """The request's URL path, without its query."""
        return urlsplit(self.request_uri).path

    @property
    def what(self) -> str:
        """What was acted on, as RBAC names it: "pods", "pods/status", or the path of a
        non-resource request ("/version")."""
        if not self.resource:
            return self.path
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    @classmethod
    def from_json(cls, event: Mapping[str, Any]) -> AuditEvent:
        ref = event.get("objectRef") or {}
        user = event.get("user") or {}
        status = event.get("responseStatus") or {}
        code = status.get("code")
        return cls(
            audit_id=str(event.get("auditID", "")),
            stage=str(event.get("stage", "")),
            verb=str(event.get("verb", "")),
            resource=str(ref.get("resource", "")),
            subresource=str(ref.get("subresource", "")),
            api_group=str(ref.get("apiGroup", "")),
            namespace=str(ref.get("namespace", "")),
            name=str(ref.get("name", "")),
            user=str(user.get("username", "")),
            groups=tuple(user.get("groups") or ()),
            user_agent=str(event.get("userAgent", "")),
            response_code=int(code) if code is not None else None,
            request_uri=str(event.get("requestURI", "")),
            request_received=_time(event.get("requestReceivedTimestamp")),
            stage_timestamp=_time(event.get("stageTimestamp")),
        )


def read_events(path: Path | str) -> list[AuditEvent]:
    """Every event in a JSON audit log, in file order. A last line without its newline
    (being written right now) is left out; any other line that is not JSON raises."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1]:  # no trailing newline: an event still being written
        lines = lines[:-1]
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON audit event: {exc}") from None
        events.append(AuditEvent.from_json(event))
    return events


def _utc(moment: dt.datetime) -> dt.datetime:
    """Naive datetimes are taken as UTC (the log's timestamps are)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


def count(
    events: Iterable[AuditEvent],
    *,
    user: str | None = None,
    user_agent_prefix: str | None = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
) -> Counter[tuple[str, str]]:
    """Requests per ``(verb, what)`` (see ``AuditEvent.what``: "configmaps",
    "pods/status", "/version"), each request counted once however many stages it logged:
    a watch counts once per watch opened, whether it is still open (ResponseStarted only)
    or ended. Filters: exact username; user agent prefix; the time the API server
    received the request, ``since <= received < until``."""
    start = _utc(since) if since is not None else None
    end = _utc(until) if until is not None else None
    seen: set[str] = set()
    counts: Counter[tuple[str, str]] = Counter()
    for event in events:
        if event.audit_id and event.audit_id in seen:
            continue
        if user is not None and event.user != user:
            continue
        if user_agent_prefix is not None and not event.user_agent.startswith(user_agent_prefix):
            continue
        received = event.request_received
        if start is not None and (received is None or received < start):
            continue
        if end is not None and (received is None or received >= end):
            continue
        seen.add(event.audit_id)
        counts[(event.verb, event.what)] += 1
    return counts
