"""The operator's Prometheus metrics (one registry, base units, low-cardinality labels)."""

from __future__ import annotations

from ctj_contract import Phase
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .decisions import Action, PatchStatus, Recovered, Restarted

PHASES = tuple(Phase)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.restarts = Counter(
            "ctj_job_restarts",
            "Attempts ended and restarted, by reason (PodFailed, HeartbeatLost, "
            "NodeNotReady, ScaleUp, Resize, ...) and cause (crash, node, planned).",
            ["reason", "cause"],
            registry=r,
        )
        self.world_size = Gauge(
            "ctj_job_world_size",
            "Nodes in the job's current attempt.",
            ["namespace", "job_name"],  # not "job": Prometheus owns that label
            registry=r,
        )
        self.attempt = Gauge(
            "ctj_job_attempt",
            "The job's current attempt (1, 2, ...): how often it restarted, whatever the cause.",
            ["namespace", "job_name"],
            registry=r,
        )
        self.recovery = Histogram(
            "ctj_job_recovery_seconds",
            "From a failure seen to the new attempt's pods all running.",
            buckets=(1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600),
            registry=r,
        )
        self.jobs = Gauge("ctj_jobs", "Jobs by phase.", ["phase"], registry=r)
        self._phases: dict[tuple[str, str], str] = {}
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)

    def job_phase(self, namespace: str, job: str, phase: str | None) -> None:
        """Record (or, with None, forget) a job's phase and refresh the per-phase counts."""
        key = (namespace, job)
        if phase is not None and self._phases.get(key) == phase:
            return  # every reconcile reports it: count again only on a change
        if phase is None:
            self._phases.pop(key, None)
            for gauge in (self.world_size, self.attempt):
                try:
                    gauge.remove(namespace, job)
                except KeyError:
                    pass
        else:
            self._phases[key] = phase
        for p in PHASES:
            self.jobs.labels(phase=p).set(sum(1 for v in self._phases.values() if v == p))

    def job_seen(self, namespace: str, job: str, phase: str, world_size: int, attempt: int) -> None:
        """What a reconcile read of the job (so a restarted operator exports every job's
        series at its first tick, not at the job's next status write)."""
        self.job_phase(namespace, job, phase)
        if attempt:
            self.attempt.labels(namespace=namespace, job_name=job).set(attempt)
        if world_size:
            self.world_size.labels(namespace=namespace, job_name=job).set(world_size)

    def record(self, namespace: str, job: str, action: Action) -> None:
        """What an applied action changes in the series."""
        match action:
            case PatchStatus(fields=fields):
                if fields.get("phase"):
                    self.job_phase(namespace, job, fields["phase"])
                if fields.get("worldSize"):
                    self.world_size.labels(namespace=namespace, job_name=job).set(
                        fields["worldSize"]
                    )
                if fields.get("attempt"):
                    self.attempt.labels(namespace=namespace, job_name=job).set(fields["attempt"])
            case Restarted(reason=reason, cause=cause):
                self.restarts.labels(reason=reason, cause=cause.value).inc()
            case Recovered(seconds=seconds):
                self.recovery.observe(seconds)
