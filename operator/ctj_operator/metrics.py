"""The operator's Prometheus metrics (one registry, base units, low-cardinality labels)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PHASES = ("Pending", "Running", "Restarting", "Succeeded", "Failed")


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
        if phase is None:
            self._phases.pop(key, None)
            try:
                self.world_size.remove(namespace, job)
            except KeyError:
                pass
        else:
            self._phases[key] = phase
        for p in PHASES:
            self.jobs.labels(phase=p).set(sum(1 for v in self._phases.values() if v == p))
