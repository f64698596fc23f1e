"""The operator's Prometheus metrics (one registry, base units, low-cardinality labels).

Per-job series carry ``namespace`` and ``job_name`` (never a pod, an attempt or a step as
a label): they outlive the job's pods and attempts, so alerts on them (a stale checkpoint,
a failed job, a job stuck pending) keep one identity per job for the job's whole life.
They are removed when the job is. The restart and recovery series stay per operator (by
reason and cause), as documented in the README.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctj_contract import Phase, parse_time
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .decisions import Action, PatchStatus, Recovered, Restarted

PHASES = tuple(Phase)
VERSION = "0.1.0"  # the project's (pyproject.toml; tests/unit/test_metrics.py keeps them equal)
COMPONENT = "operator"  # ctj_build_info's component; the checkpoint engine's is "checkpoint"


def checkpoint_interval(
    previous: tuple[int, float] | None, current: tuple[int, float]
) -> float | None:
    """Seconds between two reported checkpoints (step, commit time), or None where they
    say nothing new about the cadence: the first one seen, the same one again, or one no
    later than the last (its time is to the second)."""
    if previous is None or current[0] == previous[0] or current[1] <= previous[1]:
        return None
    return current[1] - previous[1]


def reported_checkpoint(value: Mapping[str, Any] | None) -> tuple[int, float] | None:
    """``status.lastCheckpoint`` as (step, commit time), or None where absent or unreadable
    (rank 0's sidecar writes it through its Lease: never trusted to parse)."""
    if not value:
        return None
    when = parse_time(value.get("time"))
    try:
        step = int(value["step"])
    except (KeyError, TypeError, ValueError):
        return None
    return None if when is None else (step, when)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.build_info = Gauge(
            "ctj_build_info",
            "Always 1: the version of ctj this process runs, and which component it is.",
            ["version", "component"],
            registry=r,
        )
        self.build_info.labels(version=VERSION, component=COMPONENT).set(1)
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
        self.phase = Gauge(
            "ctj_job_phase",
            "1 for the job's current phase (one series per job: it moves with the phase).",
            ["namespace", "job_name", "phase"],
            registry=r,
        )
        self.last_checkpoint = Gauge(
            "ctj_job_last_checkpoint_timestamp_seconds",
            "Unix time of the job's last committed checkpoint (status.lastCheckpoint, as "
            "rank 0's sidecar reports it): it outlives the job's pods and attempts.",
            ["namespace", "job_name"],
            registry=r,
        )
        self.last_step = Gauge(
            "ctj_job_last_checkpoint_step",
            "Step of the job's last committed checkpoint (status.lastCheckpoint).",
            ["namespace", "job_name"],
            registry=r,
        )
        self.interval = Gauge(
            "ctj_job_checkpoint_interval_seconds",
            "Time between the job's last two checkpoints this operator saw reported (absent "
            "until it has seen two).",
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
        self._checkpoints: dict[tuple[str, str], tuple[int, float]] = {}
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)

    def job_phase(self, namespace: str, job: str, phase: str | None) -> None:
        """Record (or, with None, forget) a job's phase and refresh the per-phase counts."""
        key = (namespace, job)
        before = self._phases.get(key)
        if phase is not None and before == phase:
            return  # every reconcile reports it: count again only on a change
        if before is not None:
            self.phase.remove(namespace, job, before)
        if phase is None:
            self._phases.pop(key, None)
            self._checkpoints.pop(key, None)
            for gauge in (
                self.world_size,
                self.attempt,
                self.last_checkpoint,
                self.last_step,
                self.interval,
            ):
                try:
                    gauge.remove(namespace, job)
                except KeyError:
                    pass
        else:
            self._phases[key] = phase
            self.phase.labels(namespace=namespace, job_name=job, phase=phase).set(1)
        for p in PHASES:
            self.jobs.labels(phase=p).set(sum(1 for v in self._phases.values() if v == p))

    def job_checkpoint(self, namespace: str, job: str, value: Mapping[str, Any] | None) -> None:
        """Record the job's last committed checkpoint as status.lastCheckpoint says."""
        current = reported_checkpoint(value)
        if current is None:
            return
        key = (namespace, job)
        previous = self._checkpoints.get(key)
        if previous is not None and current[1] < previous[1]:
            return  # an older report than one already seen (a stale read): keep the newer
        interval = checkpoint_interval(previous, current)
        self._checkpoints[key] = current
        self.last_step.labels(namespace=namespace, job_name=job).set(current[0])
        self.last_checkpoint.labels(namespace=namespace, job_name=job).set(current[1])
        if interval is not None:
            self.interval.labels(namespace=namespace, job_name=job).set(interval)

    def job_seen(
        self,
        namespace: str,
        job: str,
        phase: str,
        world_size: int,
        attempt: int,
        last_checkpoint: Mapping[str, Any] | None = None,
    ) -> None:
        """What a reconcile read of the job (so a restarted operator exports every job's
        series at its first tick, not at the job's next status write)."""
        self.job_phase(namespace, job, phase)
        if attempt:
            self.attempt.labels(namespace=namespace, job_name=job).set(attempt)
        if world_size:
            self.world_size.labels(namespace=namespace, job_name=job).set(world_size)
        self.job_checkpoint(namespace, job, last_checkpoint)

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
                if fields.get("lastCheckpoint"):
                    self.job_checkpoint(namespace, job, fields["lastCheckpoint"])
            case Restarted(reason=reason, cause=cause):
                self.restarts.labels(reason=reason, cause=cause.value).inc()
            case Recovered(seconds=seconds):
                self.recovery.observe(seconds)
