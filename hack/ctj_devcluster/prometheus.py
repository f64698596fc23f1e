"""A real Prometheus server for the tests: Debian's ``prometheus`` package (installed by
hack/system-tools.sh with promtool), scraping what the caller lists, evaluating rule
files, answering its HTTP API.

Targets come from file-based service discovery: ``set_targets`` rewrites one JSON file per
scrape job (atomically; Prometheus watches the directory), so a test can follow pods as
they come and go the way a PodMonitor would, and give each target the labels the
chart's PodMonitor/ServiceMonitor would (``namespace``, ``pod``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ports import retry_on_bind_conflict
from .processes import ManagedProcess


class PrometheusError(RuntimeError):
    """The server is missing, did not start, or its API refused a query."""


@dataclass(frozen=True)
class Target:
    """One scrape target: ``host:port`` and the labels it gets (besides ``job``)."""

    address: str
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass
class PrometheusConfig:
    root: Path
    jobs: Sequence[str] = ("ctj-operator", "ctj-sidecars")
    rule_files: Sequence[Path] = ()
    scrape_interval_s: float = 1.0
    evaluation_interval_s: float = 1.0
    binary: str = "prometheus"

    def __post_init__(self) -> None:
        if self.scrape_interval_s <= 0 or self.evaluation_interval_s <= 0:
            raise ValueError("scrape and evaluation intervals must be positive")
        if not self.jobs:
            raise ValueError("at least one scrape job")


class Prometheus:
    def __init__(self, config: PrometheusConfig) -> None:
        self.config = config
        self.root = config.root
        self.sd_dir = self.root / "targets"
        self.process: ManagedProcess | None = None
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------

    def _write_config(self) -> Path:
        c = self.config
        scrape = f"{c.scrape_interval_s:g}s"
        config = {
            "global": {
                "scrape_interval": scrape,
                "scrape_timeout": scrape,
                "evaluation_interval": f"{c.evaluation_interval_s:g}s",
            },
            "rule_files": [str(p) for p in c.rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "honor_labels": True,  # as the chart's monitors: the job's own labels win
                    "file_sd_configs": [
                        {"files": [str(self.sd_dir / f"{job}.json")], "refresh_interval": "1s"}
                    ],
                }
                for job in c.jobs
            ],
        }
        path = self.root / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        return path

    def start(self) -> Prometheus:
        binary = shutil.which(self.config.binary)
        if binary is None:
            raise PrometheusError(
                f"{self.config.binary} is missing: run hack/system-tools.sh (Debian package "
                "prometheus)"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self.sd_dir.mkdir(exist_ok=True)
        for job in self.config.jobs:
            self.set_targets(job, [])
        config = self._write_config()
        log = self.root / "prometheus.log"

        def launch(ports: tuple[int, ...]) -> ManagedProcess:
            argv = [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address=127.0.0.1:{ports[0]}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ]
            return ManagedProcess("prometheus", argv, log).start()

        self.process, (self.port,) = retry_on_bind_conflict(
            launch, ports=1, what="prometheus", timeout=60
        )
        self._wait_ready(60)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.process is not None:
                self.process.check_alive()
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready after {timeout:.0f}s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace=5.0)
            self.process = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- targets -----------------------------------------------------------------------

    def set_targets(self, job: str, targets: Iterable[Target]) -> None:
        """Replace the scrape job's targets (file_sd, written atomically)."""
        if job not in self.config.jobs:
            raise ValueError(f"unknown scrape job {job!r} (have {list(self.config.jobs)})")
        groups = [{"targets": [t.address], "labels": dict(t.labels)} for t in targets]
        path = self.sd_dir / f"{job}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, path)

    # -- the HTTP API ------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (a vector: [{metric: {...}, value: [t, "v"]}, ...];
        a scalar comes back as one sample without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def active_targets(self) -> list[dict[str, Any]]:
        targets: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return targets

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def series(self, match: str) -> list[dict[str, str]]:
        found: list[dict[str, str]] = self.api("series", **{"match[]": match})
        return found
