"""A real Prometheus (Debian's package) scrapes a real sidecar and evaluates the alerts ctj
ships (charts/ctj/rules/ctj-alerts.yaml): the target is up, the series carry the
documented labels and never a credential, and once uploads are blocked the failure alert
fires for the job, as Prometheus itself judges it. (The stale-checkpoint alert is judged
from the operator's series: tests/cluster/test_operator_prometheus.py has them.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ctj_devcluster.prometheus import Prometheus, PrometheusConfig, Target

from tests.integration.s3_proxy import FaultProxy
from tests.integration.test_sidecar import Sidecar, sidecar_config, wait_until
from tests.unit.test_alert_rules import RULES
from trainer_sidecar import Checkpointer

pytestmark = pytest.mark.integration

# what a sidecar's series may be labelled with: the scrape's, the PodMonitor's, its own
ALLOWED_LABELS = {
    "__name__",
    "job",
    "instance",
    "namespace",
    "pod",
    "job_name",
    "stage",
    "kind",
    "tier",
    "rank",  # the per-rank histograms (stall, upload, restore): at most slots.MAX_RANKS values
    "le",
    "version",
    "component",
}


def firing(prom: Prometheus) -> dict[str, dict[str, str]]:
    return {a["labels"]["alertname"]: a["labels"] for a in prom.alerts() if a["state"] == "firing"}


def test_prometheus_scrapes_a_sidecar_and_the_failure_alert_fires_for_its_job(
    s3_uri: str,
    s3_env: dict[str, str],
    s3_proxy: Callable[..., FaultProxy],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy = s3_proxy()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # the sidecar's S3, and ours
    staging = tmp_path / "staging"
    sidecar = Sidecar(s3_uri, staging, tmp_path / "sidecar.log")
    config = PrometheusConfig(tmp_path / "prometheus", jobs=("ctj-sidecars",), rule_files=[RULES])
    with Prometheus(config) as prom, sidecar:
        # the labels the chart's PodMonitor gives a sidecar of job "demo"
        labels = {"namespace": "ml", "job_name": "demo", "pod": "demo-a1-0"}
        prom.set_targets("ctj-sidecars", [Target(f"127.0.0.1:{sidecar.port}", labels)])
        ckpt = Checkpointer(sidecar_config(s3_uri, staging))
        model = torch.nn.Linear(8, 8)
        for step in (1, 2, 3):
            ckpt.save(step, model=model).result()  # type: ignore[union-attr]

        def scraped_step() -> float | None:
            result = prom.query('ctj_checkpoint_last_committed_step{pod="demo-a1-0"}')
            return float(result[0]["value"][1]) if result else None

        wait_until(lambda: scraped_step() == 3, "Prometheus to scrape step 3", 60)
        (target,) = prom.active_targets()
        assert target["health"] == "up", target
        series = prom.series('{__name__=~"ctj_.*"}')
        names = {s["__name__"] for s in series}
        assert {
            "ctj_checkpoint_commit_seconds_bucket",
            "ctj_checkpoint_interval_seconds",
            "ctj_staging_used_bytes",
            "ctj_checkpoint_failures_total",
            "ctj_build_info",
        } <= names
        for s in series:
            assert set(s) <= ALLOWED_LABELS, s
            secrets = {s3_env["AWS_SECRET_ACCESS_KEY"], s3_env["AWS_ACCESS_KEY_ID"]}
            assert not secrets & set(s.values()), s
        assert prom.query('ctj_build_info{component="checkpoint", job_name="demo"} == 1')
        assert set(firing(prom)) <= {"CtjOperatorAbsent"}, "nothing else is wrong yet"

        # the store stops answering: the next save never commits
        proxy.faults = ("internal_error",)
        proxy.fault_rate = 1.0
        ckpt.save(4, model=model)
        wait_until(lambda: "CtjCheckpointFailing" in firing(prom), "the failure alert to fire", 120)
        alert = firing(prom)["CtjCheckpointFailing"]
        assert alert["stage"] == "upload"
        assert {k: alert[k] for k in ("namespace", "job_name")} == {
            "namespace": "ml",
            "job_name": "demo",
        }
        assert "pod" not in alert and "instance" not in alert, "one alert per job, not per pod"
        ckpt.close(wait_for_commit=False)
