"""The sidecar's Lease heartbeat, its pure parts: the patch body, when rank 0's annotation
goes (again), request ids, MicroTime, rate-limited failure lines; the API call is a fake."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from ctj_contract import ANNOTATION_CHECKPOINT_REQUEST, ANNOTATION_LAST_CHECKPOINT, micro_time

from tests.conftest import ROOT
from trainer_sidecar import heartbeat as hb
from trainer_sidecar.errors import CheckpointError
from trainer_sidecar.metrics import CheckpointMetrics, HeartbeatMetrics
from trainer_sidecar.save import slots

T0 = 1796126400.123456  # 2026-12-01T12:00:00.123456Z


@dataclasses.dataclass
class Commit:
    step: int
    created: float = T0
    logical_bytes: int = 4096


class FakeLease:
    """The API server's side: applies merge patches to one Lease, or fails as told."""

    def __init__(self) -> None:
        self.annotations: dict[str, str] = {}
        self.renew: str | None = None
        self.bodies: list[dict[str, Any]] = []
        self.fail: BaseException | None = None
        self.lock = threading.Lock()

    def patch(self, body: dict[str, Any]) -> Mapping[str, Any]:
        with self.lock:
            self.bodies.append(body)
            if self.fail is not None:
                raise self.fail
            self.renew = body["spec"]["renewTime"]
            self.annotations.update((body.get("metadata") or {}).get("annotations") or {})
            return {
                "metadata": {"name": "p-0", "annotations": dict(self.annotations)},
                "spec": {"renewTime": self.renew, "holderIdentity": "p-0"},
            }


class ApiError(Exception):
    """The shape of kubernetes.client.ApiException."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason
        self.body = json.dumps({"kind": "Status", "message": message, "code": status})


def settings(rank0: bool = True, period_s: float = 2.0) -> hb.HeartbeatSettings:
    return hb.HeartbeatSettings(lease="p-0", namespace="ns", period_s=period_s, rank0=rank0)


def make(
    tmp_path: Path, *, rank0: bool = True, latest: list[Commit] | None = None, **kw: Any
) -> tuple[hb.Heartbeat, FakeLease, list[Commit]]:
    lease = FakeLease()
    commits = [] if latest is None else latest
    beat = hb.Heartbeat(
        settings(rank0),
        patch=lease.patch,
        latest=lambda: commits[-1] if commits else None,
        root=tmp_path,
        clock=lambda: T0,
        **kw,
    )
    return beat, lease, commits


def sent_annotation(body: dict[str, Any]) -> str | None:
    return (body.get("metadata") or {}).get("annotations", {}).get(ANNOTATION_LAST_CHECKPOINT)


# -- formats --------------------------------------------------------------------------


def test_micro_time_is_rfc3339_utc_with_microseconds() -> None:
    assert micro_time(T0) == "2026-12-01T12:00:00.123456Z"
    assert micro_time(1796126400.0) == "2026-12-01T12:00:00.000000Z"
    assert micro_time(1796126400.9999996) == "2026-12-01T12:00:01.000000Z"  # no 60th second


def test_last_checkpoint_is_compact_json_of_step_time_bytes() -> None:
    value = hb.last_checkpoint_value(Commit(step=120, logical_bytes=1 << 20))
    assert value == '{"step":120,"time":"2026-12-01T12:00:00Z","bytes":1048576}'


def test_rank0_body_carries_the_annotation_other_ranks_only_renew(tmp_path: Path) -> None:
    rank0, _, _ = make(tmp_path, latest=[Commit(step=7)])
    other, _, _ = make(tmp_path, rank0=False, latest=[Commit(step=7)])
    assert rank0.body() == {
        "spec": {"renewTime": "2026-12-01T12:00:00.123456Z"},
        "metadata": {
            "annotations": {
                "training.ctj.dev/last-checkpoint": (
                    '{"step":7,"time":"2026-12-01T12:00:00Z","bytes":4096}'
                )
            }
        },
    }
    assert other.body() == {"spec": {"renewTime": "2026-12-01T12:00:00.123456Z"}}


def test_no_annotation_before_any_commit(tmp_path: Path) -> None:
    beat, lease, _ = make(tmp_path)
    assert beat.beat()
    assert lease.bodies == [{"spec": {"renewTime": "2026-12-01T12:00:00.123456Z"}}]


# -- when the annotation is (re)sent ----------------------------------------------------


def test_annotation_is_sent_once_per_change(tmp_path: Path) -> None:
    beat, lease, commits = make(tmp_path, latest=[Commit(step=10)])
    beat.beat()
    beat.beat()
    commits.append(Commit(step=20, logical_bytes=8192))
    beat.beat()
    beat.beat()
    sent = [sent_annotation(b) for b in lease.bodies]
    assert [json.loads(s)["step"] if s else None for s in sent] == [10, None, 20, None]
    assert json.loads(lease.annotations[ANNOTATION_LAST_CHECKPOINT]) == {
        "step": 20,
        "time": "2026-12-01T12:00:00Z",
        "bytes": 8192,
    }


def test_annotation_is_resent_after_a_failed_patch(tmp_path: Path) -> None:
    beat, lease, commits = make(tmp_path, latest=[Commit(step=10)])
    lease.fail = ApiError(503, "Service Unavailable", "etcd leader changed")
    assert not beat.beat()
    lease.fail = None
    assert beat.beat()
    assert [sent_annotation(b) is not None for b in lease.bodies] == [True, True]
    assert beat.beat() and sent_annotation(lease.bodies[-1]) is None


def test_annotation_is_resent_when_the_lease_lost_it(tmp_path: Path) -> None:
    """A Lease deleted and created again (or annotated by someone else) gets it back."""
    beat, lease, _ = make(tmp_path, latest=[Commit(step=10)])
    beat.beat()
    lease.annotations.clear()
    beat.beat()  # the reply shows the Lease without it
    beat.beat()
    assert [sent_annotation(b) is not None for b in lease.bodies] == [True, False, True]


def test_a_lease_already_carrying_the_value_is_not_patched_with_it(tmp_path: Path) -> None:
    """A restarted sidecar whose Lease carries its latest commit sends it no more."""
    beat, lease, _ = make(tmp_path, latest=[Commit(step=10)])
    lease.annotations[ANNOTATION_LAST_CHECKPOINT] = hb.last_checkpoint_value(Commit(step=10))
    beat.beat()  # the first beat does not know yet, so it sends
    beat.beat()
    assert [sent_annotation(b) is not None for b in lease.bodies] == [True, False]


# -- checkpoint requests ------------------------------------------------------------------


def test_a_new_request_id_is_written_atomically_once(tmp_path: Path) -> None:
    beat, lease, _ = make(tmp_path)
    beat.beat()
    assert slots.read_request(tmp_path) is None and not (tmp_path / slots.REQUEST_FILE).exists()
    lease.annotations[ANNOTATION_CHECKPOINT_REQUEST] = "resize-3"
    beat.beat()
    path = tmp_path / "checkpoint-request"
    assert path.read_text() == "resize-3"
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-request"]  # no tmp left
    path.unlink()
    beat.beat()  # the same id again: not written again
    assert not path.exists()
    lease.annotations[ANNOTATION_CHECKPOINT_REQUEST] = "resize-4"
    beat.beat()
    assert path.read_text() == "resize-4" and beat.request_seen == "resize-4"


def test_an_empty_request_annotation_is_no_request(tmp_path: Path) -> None:
    beat, lease, _ = make(tmp_path)
    lease.annotations[ANNOTATION_CHECKPOINT_REQUEST] = "  "
    beat.beat()
    assert slots.read_request(tmp_path) is None


def test_a_request_already_in_the_root_is_known_at_start(tmp_path: Path) -> None:
    slots.write_request(tmp_path, "resize-3")
    beat, lease, _ = make(tmp_path)
    assert beat.request_seen == "resize-3"
    lease.annotations[ANNOTATION_CHECKPOINT_REQUEST] = "resize-3"
    os.utime(tmp_path / slots.REQUEST_FILE, (0, 0))
    beat.beat()
    assert (tmp_path / slots.REQUEST_FILE).stat().st_mtime == 0  # not rewritten


def test_a_request_that_cannot_be_written_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "gone"
    beat, lease, _ = make(root)
    lease.annotations[ANNOTATION_CHECKPOINT_REQUEST] = "resize-3"
    with caplog.at_level(logging.WARNING, "ctj.heartbeat"):
        assert beat.beat()  # the beat itself worked
    assert "writing" in caplog.text and "failed" in caplog.text and beat.request_seen is None
    root.mkdir(mode=0o700)
    beat.beat()
    assert slots.read_request(root) == "resize-3"


# -- failures: one line, rate-limited ---------------------------------------------------------


def test_failures_are_logged_once_per_interval_and_recovery_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    limited = hb.RateLimitedLog(
        logging.getLogger("ctj.heartbeat"),
        "heartbeat: renewing Lease ns/p-0",
        clock=lambda: now[0],
    )
    with caplog.at_level(logging.INFO, "ctj.heartbeat"):
        logged = []
        for _ in range(10):  # 10 beats, 2 s apart: one line
            logged.append(limited.failure('404 Not Found: leases "p-0" not found'))
            now[0] += 2
        now[0] += 30
        logged.append(limited.failure("404 Not Found"))  # past the interval: another, counted
        assert logged == [True] + [False] * 9 + [True]
        assert limited.success() and not limited.success()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        'heartbeat: renewing Lease ns/p-0 failed: 404 Not Found: leases "p-0" not found; '
        "still persisting",
        "heartbeat: renewing Lease ns/p-0 failed: 404 Not Found (9 more since the last report); "
        "still persisting",
        "heartbeat: renewing Lease ns/p-0 works again, after 11 failures",
    ]


def test_a_failing_beat_is_counted_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = HeartbeatMetrics(CheckpointMetrics().registry)
    beat, lease, _ = make(tmp_path, metrics=metrics)
    lease.fail = ApiError(403, "Forbidden", 'leases.coordination.k8s.io "p-0" is forbidden')
    with caplog.at_level(logging.WARNING, "ctj.heartbeat"):
        assert not beat.beat() and not beat.beat()
        lease.fail = ConnectionRefusedError(111, "Connection refused")
        assert not beat.beat()
    lease.fail = None
    assert beat.beat()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w.count("403 Forbidden") for w in warnings] == [1]
    assert (beat.beats, beat.failures) == (4, 3)
    assert metrics.failures._value.get() == 3 and metrics.beats._value.get() == 1


def test_describe_is_one_line_with_the_api_servers_message() -> None:
    from kubernetes.client.exceptions import ApiException

    exc = ApiException(status=404, reason="Not Found")
    exc.body = json.dumps({"message": 'leases.coordination.k8s.io "p-0" not found'})
    assert hb.describe(exc) == '404 Not Found: leases.coordination.k8s.io "p-0" not found'
    assert hb.describe(ValueError("a\nb")) == "ValueError: a b"
    assert len(hb.describe(OSError("x" * 1000))) == 300


# -- settings -------------------------------------------------------------------------------


def test_settings_from_the_environment() -> None:
    assert hb.HeartbeatSettings.from_env({}) is None  # no Lease: no heartbeat
    got = hb.HeartbeatSettings.from_env(
        {"CTJ_HEARTBEAT_LEASE": "job-1-0", "CTJ_POD_NAMESPACE": "team", "NODE_RANK": "0"}
    )
    assert got == hb.HeartbeatSettings(lease="job-1-0", namespace="team", period_s=2.0, rank0=True)
    other = hb.HeartbeatSettings.from_env(
        {
            "CTJ_HEARTBEAT_LEASE": "job-1-1",
            "CTJ_POD_NAMESPACE": "team",
            "CTJ_HEARTBEAT_PERIOD_S": "0.5",
            "NODE_RANK": "1",
        }
    )
    assert other is not None and (other.period_s, other.rank0) == (0.5, False)
    assert other.request_timeout_s == 1.0
    with pytest.raises(CheckpointError, match="CTJ_HEARTBEAT_PERIOD_S='soon' is not a number"):
        hb.HeartbeatSettings.from_env(
            {"CTJ_HEARTBEAT_LEASE": "x", "CTJ_POD_NAMESPACE": "n", "CTJ_HEARTBEAT_PERIOD_S": "soon"}
        )
    with pytest.raises(CheckpointError, match="positive"):
        hb.HeartbeatSettings(lease="x", namespace="n", period_s=0)


# -- the thread --------------------------------------------------------------------------------


def test_the_thread_beats_until_stopped_then_reports_a_late_commit(tmp_path: Path) -> None:
    lease = FakeLease()
    commits: list[Commit] = []
    beat = hb.Heartbeat(
        settings(period_s=0.01),
        patch=lease.patch,
        latest=lambda: commits[-1] if commits else None,
        root=tmp_path,
    )
    closed = threading.Event()
    beat._close = closed.set
    beat.start()
    give_up = time.monotonic() + 30
    while len(lease.bodies) < 3 and time.monotonic() < give_up:
        time.sleep(0.01)
    with lease.lock:  # a commit at the very end: the stop's last beat reports it
        beat._stop.set()
        commits.append(Commit(step=5))
    beat.stop()
    assert not beat.alive and closed.is_set()
    assert json.loads(lease.annotations[ANNOTATION_LAST_CHECKPOINT])["step"] == 5
    renewals = [b["spec"]["renewTime"] for b in lease.bodies]
    assert renewals == sorted(renewals) and len(renewals) >= 4


def test_the_heartbeat_module_imports_neither_torch_nor_kubernetes() -> None:
    code = (
        "import sys, trainer_sidecar.heartbeat, trainer_sidecar.sidecar;"
        "print(sorted(m for m in ('torch', 'kubernetes') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# -- the trainer's side, and the persister's accessor ------------------------------------------


def test_a_request_file_is_a_preemption_request(tmp_path: Path) -> None:
    from trainer_sidecar import CheckpointConfig, Checkpointer

    ckpt = Checkpointer(
        CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(tmp_path / "stage"))
    )
    assert not ckpt.preemption_requested() and ckpt.checkpoint_request() is None
    ckpt.root.mkdir(parents=True)
    slots.write_request(ckpt.root, "resize-3")
    assert ckpt.preemption_requested() and ckpt.checkpoint_request() == "resize-3"


def test_the_persister_knows_its_latest_commit(tmp_path: Path) -> None:
    import torch

    from trainer_sidecar import CheckpointConfig, Checkpointer

    config = CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(tmp_path / "stage"))
    with Checkpointer(config) as ckpt:
        model = torch.nn.Linear(4, 4)
        ckpt.save(3, model=model).result()  # type: ignore[union-attr]
        persister = ckpt._persister
        assert persister is not None
        latest = persister.latest_committed()
        assert latest is not None and latest.step == 3 and latest.logical_bytes > 0
    from trainer_sidecar.save.persist import Persister

    fresh = Persister(ckpt.store, config, root=ckpt.root, metrics=CheckpointMetrics())
    assert fresh.latest_committed() is None
    fresh.publish_latest()  # what a restarted sidecar finds committed
    found = fresh.latest_committed()
    assert found is not None and found.step == 3


def test_a_lease_deleted_after_renewals_ends_the_attempt_once(tmp_path: Path) -> None:
    ended: list[bool] = []
    beat, lease, _ = make(tmp_path, on_gone=lambda: ended.append(True))
    lease.fail = ApiError(404, "Not Found", 'leases.coordination.k8s.io "p-0" not found')
    assert not beat.beat()  # never renewed: not created yet, not an ended attempt
    lease.fail = ApiError(403, "Forbidden", "forbidden")
    assert not beat.beat()
    assert ended == [] and not beat.gone
    lease.fail = None
    assert beat.beat()
    lease.fail = ApiError(404, "Not Found", 'leases.coordination.k8s.io "p-0" not found')
    assert not beat.beat() and not beat.beat()
    assert ended == [True] and beat.gone


def test_a_commit_waiting_for_parts_stops_when_the_attempt_ends(tmp_path: Path) -> None:
    """Rank 1's node is gone: its part never comes. Once the operator has ended the
    attempt, rank 0's commit stops waiting (not the 600 s commit timeout)."""
    from trainer_sidecar import CheckpointConfig
    from trainer_sidecar.errors import SaveFailed
    from trainer_sidecar.format.manifest import SaveIdentity
    from trainer_sidecar.save.persist import Persister
    from trainer_sidecar.store.s3 import open_store

    config = CheckpointConfig(uri=f"file://{tmp_path}/store", staging_dir=str(tmp_path / "s"))
    persister = Persister(
        open_store(config.uri), config, root=tmp_path / "s", metrics=CheckpointMetrics()
    )
    staged = types.SimpleNamespace(
        step=20, save=SaveIdentity("a1", "0123456789abcdef"), world_size=2
    )
    threading.Timer(0.2, persister.attempt_ended).start()
    started = time.monotonic()
    with pytest.raises(SaveFailed, match=r"attempt ended .* 0 of 2 ranks uploaded"):
        persister._wait_for_parts(staged)  # type: ignore[arg-type]
    assert time.monotonic() - started < config.commit_timeout_s / 10
