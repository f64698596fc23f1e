"""The running operator's state, in one object the handlers are given (kopf's memo).

Nothing of the operator lives in module globals: its settings, its API clients, the leader
election, the metrics, the heartbeat channel, the marks the watches leave and
what it last wrote are here, made once by ``__main__`` and handed to kopf as
``memo.operator``.
"""

from __future__ import annotations

import dataclasses

from .apply import Api
from .builders import DEFAULT_SIDECAR_IMAGE
from .heartbeats import HeartbeatChannel
from .leader import LeaderElection
from .metrics import OperatorMetrics
from .network_policy import NetworkPolicyParams
from .observe import Marks
from .spec import NodeCache


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OperatorConfig:
    sidecar_image: str = DEFAULT_SIDECAR_IMAGE
    """The checkpoint sidecar's image for jobs that name none (--sidecar-image)."""
    node_cache: NodeCache | None = None
    """The node-local chunk cache (--node-cache-path, --node-cache-size); None: off."""
    network_policy: NetworkPolicyParams | None = None
    """Each job's NetworkPolicy (network_policy.py); None: none (--no-network-policy)."""
    job_key: bytes = dataclasses.field(default=b"\0" * 32, repr=False)
    """The cluster key each job's token is derived from (--job-key-file; the chart's
    Secret, also the node agents'); ctj_contract.tokens."""


@dataclasses.dataclass(slots=True, kw_only=True)
class Operator:
    api: Api
    config: OperatorConfig = dataclasses.field(default_factory=OperatorConfig)
    metrics: OperatorMetrics = dataclasses.field(default_factory=OperatorMetrics)
    leader: LeaderElection | None = None
    """None: act at once (--no-leader-election)."""
    marks: Marks = dataclasses.field(default_factory=Marks)
    channel: HeartbeatChannel | None = None
    """Asks every rank's sidecar for its heartbeat (made by ``__main__`` with the cluster
    key, over ``marks.beats``); None: no heartbeats (unit tests)."""
    written: dict[str, str] = dataclasses.field(default_factory=dict)
    """Job uid -> the resourceVersion of our last status write: a body older than that is
    a lagging watch's, and is not acted on."""
    fits_logged: dict[str, int] = dataclasses.field(default_factory=dict)
    """Job uid -> how many nodes fit a rank when it was last logged."""
    refused: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    """Job uid -> (attempt, why the API refused one of its objects as it was created):
    the next reconcile ends that attempt with the reason."""

    def leads(self) -> bool:
        return self.leader is None or self.leader.is_leader()

    def stale(self, uid: str, resource_version: str) -> bool:
        """The body is older than our own last write: wait for the watch to catch up."""
        written = self.written.get(uid)
        try:
            return written is not None and int(resource_version) < int(written)
        except ValueError:  # resourceVersions are opaque; etcd's are integers
            return False

    def forget(self, uid: str) -> None:
        self.written.pop(uid, None)
        self.fits_logged.pop(uid, None)
        self.refused.pop(uid, None)
