"""Recovery after a node loss, with Kubernetes' default failure timings, by wall clock.

A job of 3 ranks runs examples/train_fsdp.py (as tests/cluster/operator_env.py's
``job_manifest`` builds it: a checkpoint every 10 steps) on a local cluster of 3 nodes
(ctj_devcluster) whose controller manager keeps the upstream timings: node-monitor
grace period ``--node-grace`` (40 s, the pre-1.32 default and the harder case for the
heartbeat; kube-controller-manager 1.32+, ours 1.34, defaults to 50 s) and node-monitor
period 5 s. The operator runs with its defaults (each rank's sidecar asked for a heartbeat every
1 s, a rank or its trainer silent after 3 s), against a moto S3 (``LocalS3``). Each round:

1. waits for steady training: the current attempt at world size 3, every pod Running,
   and a checkpoint committed by that attempt;
2. SIGKILLs the node agent of rank 1 and everything it runs (``Cluster.kill_node``: the
   machine is lost, nothing says goodbye), and notes the time;
3. measures, by the same wall clock (the trainer's JSON events carry ``time.time()``):
   detection (the operator's decision to restart: ``status.teardownSince``, the
   ``Restarted`` condition), the next attempt created (``status.attemptStarted``), its
   pods Running (polled every 0.2 s: the native sidecar runs), the last rank's trainer
   container started (its ``startedAt``), the restore starting and ending (the
   ``restored`` event, its ``seconds``) and the first ``step`` after it; and the steps
   lost (the last step the old attempt trained minus the step restored). If that attempt
   ends too (e.g. a rank bound to the lost node, which still reads Ready), the next one
   is followed until one trains: the round counts to its first step;
4. restarts the node and waits until the job has grown back to 3 (a ``ScaleUp`` after
   ``--stabilization`` seconds) before the next round.

The target (issue 26, docs/benchmarks.md): kill -> first step <= 10 s (without a spare),
plus the restore itself; it was 30 s before detection took 3 s.

Usage:

    source hack/env.sh
    python bench/bench_recovery.py                 # 3 rounds, ~10 min here
    python bench/bench_recovery.py --rounds 5 --json /tmp/recovery.json

Needs root (the node agents) and the cluster binaries (hack/cluster-binaries.sh).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Cluster, ClusterConfig, find_binaries
from ctj_devcluster.local_s3 import LocalS3
from ctj_stack.jobs import (
    FAST_TRAINING,
    OperatorProcess,
    attempt_of,
    install_crd,
    job_manifest,
    job_pods,
    rank0_events,
    rank_pod,
    running,
    status,
)
from kubernetes import client

ROOT = Path(__file__).resolve().parents[1]

JOB_NS, JOB = "bench", "recover"
WORLD = 3
TARGET_S = 10.0
"""kill -> first step after the restore, not counting the restore itself."""
T = TypeVar("T")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _wait(what: str, timeout: float, check: Callable[[], T | None], interval: float = 1.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Round:
    index: int
    attempt: int
    """The attempt the kill ended."""
    trained: int
    """The attempt that trained again: attempt + 1 unless that one ended too."""
    node: str
    node_of_next: list[str]
    """Where each rank of attempt + 1 was scheduled (the lost node among them: a retry)."""
    reasons: list[str]
    """The Restarted reason of each attempt ended on the way (HeartbeatLost: the heartbeat;
    NodeNotReady: the node-monitor grace; ...)."""
    restored_step: int
    last_step: int
    world_after: int
    detect_s: float
    """kill -> the operator decided to restart (status.teardownSince)."""
    created_s: float
    """kill -> the attempt that trained was created (status.attemptStarted)."""
    pods_running_s: float
    """kill -> every pod of that attempt Running (polled): its native sidecar started."""
    trainer_started_s: float
    """kill -> the last rank's trainer container started (its status's startedAt, whole
    seconds; the sidecar's startup probe passed)."""
    rendezvous_s: float
    """kill -> every rank met (the restored event's ``rendezvous``: init_process_group
    returned; the trainer container's start-up before it is its imports)."""
    restore_begin_s: float
    """kill -> the restore began (restored.t - restored.seconds)."""
    restored_s: float
    """kill -> the ``restored`` event."""
    first_step_s: float
    """kill -> the first ``step`` event after it."""
    restore_seconds: float
    """The restore's own duration (the ``restored`` event's ``seconds``)."""

    @property
    def lost_steps(self) -> int:
        return self.last_step - self.restored_step

    @property
    def retries(self) -> int:
        return self.trained - self.attempt - 1

    @property
    def stages(self) -> dict[str, float]:
        """The kill -> first step interval in consecutive pieces."""
        return {
            "detection": self.detect_s,
            "teardown (+ any attempt that failed)": self.created_s - self.detect_s,
            "pods bound and Running (sidecar started)": self.pods_running_s - self.created_s,
            "trainer container started": self.trainer_started_s - self.pods_running_s,
            "trainer start-up (imports, rendezvous)": self.rendezvous_s - self.trainer_started_s,
            "model built, Checkpointer made, restore planned": (
                self.restore_begin_s - self.rendezvous_s
            ),
            "restore": self.restored_s - self.restore_begin_s,
            "first step": self.first_step_s - self.restored_s,
        }

    @property
    def target_met(self) -> bool:
        return self.first_step_s <= TARGET_S + self.restore_seconds


def _prepare(cluster: Cluster, s3: LocalS3) -> None:
    install_crd(cluster)
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespace({"metadata": {"name": JOB_NS}})
    _wait(
        "the default service account",
        30,
        lambda: core.list_namespaced_service_account(JOB_NS).items,
        0.2,
    )
    env = s3.env()
    core.create_namespaced_secret(
        JOB_NS,
        {
            "metadata": {"name": "s3-credentials"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
            },
        },
    )


def _events(cluster: Cluster, attempt: int, kind: str) -> list[dict[str, Any]]:
    """The ``kind`` events rank 0 of ``attempt`` printed."""
    return [e for e in rank0_events(cluster, JOB_NS, JOB, attempt) if e.get("event") == kind]


def _steady(cluster: Cluster, timeout: float) -> int:
    """The current attempt once it runs at 3 with a checkpoint of its own committed."""

    def ready() -> int | None:
        st = status(cluster, JOB_NS, JOB)
        attempt = st.get("attempt")
        if not attempt or not running(cluster, JOB_NS, JOB, attempt, WORLD):
            return None
        committed = [
            e for e in rank0_events(cluster, JOB_NS, JOB, attempt) if e["event"] == "committed"
        ]
        return attempt if committed else None

    return _wait("the job at world size 3 with a commit", timeout, ready)


def measure_round(cluster: Cluster, index: int, args: argparse.Namespace) -> Round:
    attempt = _steady(cluster, args.timeout)
    time.sleep(args.settle)
    victim = rank_pod(cluster, JOB_NS, JOB, attempt, 1)
    node = victim.spec.node_name
    log(f"round {index}: attempt {attempt} trains at 3; killing {node} (rank 1)")
    killed = time.time()
    cluster.kill_node(node)

    teardown_since: float | None = None
    created: dict[int, float] = {}
    pods_running: dict[int, float] = {}
    trainer_started: dict[int, float] = {}
    placed: dict[int, list[str]] = {}
    ended: dict[str, str] = {}  # status.teardownSince of each attempt ended -> its reason
    restored: dict[str, Any] | None = None
    first_step: dict[str, Any] | None = None
    current = attempt
    deadline = time.monotonic() + args.timeout
    while first_step is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {index}: no attempt trained again in {args.timeout}s")
        st = status(cluster, JOB_NS, JOB)
        current = int(st.get("attempt") or 0)
        if teardown_since is None and st.get("teardownSince") is not None:
            teardown_since = float(st["teardownSince"])
        if st.get("teardownSince") is not None:  # set anew each time an attempt ends
            why = [c for c in st.get("conditions") or [] if c.get("type") == "Restarted"]
            ended[str(st["teardownSince"])] = why[0].get("reason", "") if why else ""
        if current > attempt and current not in created and st.get("attemptStarted"):
            created[current] = float(st["attemptStarted"])
        if current in created and current not in pods_running:
            pods = [p for p in job_pods(cluster, JOB_NS, JOB) if attempt_of(p) == current]
            world = st.get("worldSize") or 0
            bound = len(pods) == world and all(p.spec.node_name for p in pods)
            if current not in placed and bound:
                placed[current] = sorted(p.spec.node_name for p in pods)
            if len(pods) == world and all(p.status.phase == "Running" for p in pods):
                pods_running[current] = time.time()
        if current in pods_running and current not in trainer_started:
            pods = [p for p in job_pods(cluster, JOB_NS, JOB) if attempt_of(p) == current]
            started = _trainer_started(pods)
            if started is not None:
                trainer_started[current] = max(started, pods_running[current])
        if current in created:
            found = _events(cluster, current, "restored")
            restored = found[0] if found else None
            steps = _events(cluster, current, "step") if restored else []
            first_step = steps[0] if steps else None
        time.sleep(0.2)
    assert restored is not None and teardown_since is not None
    restore_begin = float(restored["t"]) - float(restored["seconds"])
    if current not in pods_running:  # the restore was quicker than a poll
        pods_running[current] = restore_begin
    if current not in trainer_started:
        pods = [p for p in job_pods(cluster, JOB_NS, JOB) if attempt_of(p) == current]
        trainer_started[current] = _trainer_started(pods) or pods_running[current]
    last_step = _events(cluster, attempt, "step")[-1]["step"]
    r = Round(
        index=index,
        attempt=attempt,
        trained=current,
        node=node,
        node_of_next=placed.get(attempt + 1, []),
        reasons=[ended[k] for k in sorted(ended)],
        restored_step=int(restored["step"]),
        last_step=int(last_step),
        world_after=int(restored["world_size"]),
        detect_s=teardown_since - killed,
        created_s=created[current] - killed,
        pods_running_s=pods_running[current] - killed,
        trainer_started_s=trainer_started[current] - killed,
        rendezvous_s=float(restored.get("rendezvous", restored["t"])) - killed,
        restore_begin_s=float(restored["t"]) - float(restored["seconds"]) - killed,
        restored_s=float(restored["t"]) - killed,
        first_step_s=float(first_step["t"]) - killed,
        restore_seconds=float(restored["seconds"]),
    )
    log(
        f"round {index}: {', '.join(r.reasons)}; attempt {current} placed "
        f"{placed.get(current)}, first step {r.first_step_s:.1f}s after the kill "
        f"(restore {r.restore_seconds:.2f}s), {r.lost_steps} steps lost"
        + (f"; attempt {attempt + 1} was placed on {r.node_of_next}" if r.retries else "")
    )

    log(f"round {index}: restarting {node}; waiting for the job to grow back to 3")
    cluster.restart_node(node)

    def grown() -> bool:
        st = status(cluster, JOB_NS, JOB)
        a = st.get("attempt") or 0
        return a > current and bool(running(cluster, JOB_NS, JOB, a, WORLD))

    _wait("the job back at world size 3", args.timeout + args.stabilization, grown)
    return r


def _trainer_started(pods: list[Any]) -> float | None:
    """When the last rank's trainer container started, once every rank's has."""
    times = []
    for pod in pods:
        statuses = {c.name: c for c in pod.status.container_statuses or []}
        trainer = statuses.get("trainer")
        state = trainer.state if trainer is not None else None
        run = state and (state.running or state.terminated)
        if not run or not run.started_at:
            return None
        times.append(run.started_at.timestamp())
    return max(times) if times else None


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def table(rounds: list[Round]) -> str:
    head = (
        "| round | restarted for | a rank of the next attempt on the lost node | detection s "
        "| attempt that trained created s | pods Running s | trainer started s "
        "| restore begins s | restored s | first step s | restore's own s | steps lost "
        "| target met |"
    )
    lines = [head, "| ---: | --- | --- |" + " ---: |" * 9 + " --- |"]
    for r in rounds:
        on_lost = "yes" if r.node in r.node_of_next else "no"
        lines.append(
            f"| {r.index} | {' + '.join(r.reasons)} | {on_lost} | {r.detect_s:.1f} "
            f"| {r.created_s:.1f} "
            f"| {r.pods_running_s:.1f} | {r.trainer_started_s:.1f} "
            f"| {r.restore_begin_s:.1f} | {r.restored_s:.1f} "
            f"| {r.first_step_s:.1f} | {r.restore_seconds:.2f} | {r.lost_steps} "
            f"| {'yes' if r.target_met else 'no'} |"
        )
    if len(rounds) > 1:
        cols = [
            [r.detect_s for r in rounds],
            [r.created_s for r in rounds],
            [r.pods_running_s for r in rounds],
            [r.trainer_started_s for r in rounds],
            [r.restore_begin_s for r in rounds],
            [r.restored_s for r in rounds],
            [r.first_step_s for r in rounds],
            [r.restore_seconds for r in rounds],
            [float(r.lost_steps) for r in rounds],
        ]
        met = sum(r.target_met for r in rounds)
        lines.append(
            "| median (min–max) | | | "
            + " | ".join(_spread(c) for c in cols)
            + f" | {met}/{len(rounds)} |"
        )
    return "\n".join(lines)


def breakdown(rounds: list[Round]) -> str:
    """The stages over every round, and over the rounds whose next attempt trained (no
    rank of it placed where it could not run)."""
    clean = [r for r in rounds if not r.retries]
    groups = [(f"all {len(rounds)} rounds", rounds)]
    if clean and len(clean) < len(rounds):
        groups.append((f"the {len(clean)} without a retry", clean))
    lines = [
        "| stage | " + " | ".join(f"s, median (min–max), {g}" for g, _ in groups) + " |",
        "| --- |" + " ---: |" * len(groups),
    ]
    for stage in rounds[0].stages:
        cells = [_spread([r.stages[stage] for r in rs]) for _, rs in groups]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    cells = [_spread([r.first_step_s for r in rs]) for _, rs in groups]
    lines.append("| kill -> first step | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextmanager
def _no_interrupts() -> Iterator[None]:
    """Teardown runs to its end: a second Ctrl-C (or SIGTERM) waits until it is done."""
    pending: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        pending.append(signum)

    before = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if pending:
            raise KeyboardInterrupt


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> tuple[list[Round], float]:
    root = Path(tempfile.mkdtemp(prefix="ctj-bench-recovery-"))
    config = ClusterConfig(
        root=root,
        nodes=WORLD,
        node_monitor_grace_period=args.node_grace,
        node_monitor_period=args.node_monitor_period,
    )
    cluster = Cluster(config, find_binaries())
    s3: LocalS3 | None = None
    operator: OperatorProcess | None = None
    rounds: list[Round] = []
    started = 0.0
    try:
        log(f"starting 3 nodes (node-monitor grace {args.node_grace:g}s) in {root}")
        cluster.start()
        s3 = LocalS3.start()
        bucket = f"ctj-bench-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(bucket)
        _prepare(cluster, s3)
        operator = OperatorProcess(cluster, root / "operator.log")
        operator.start()
        manifest = job_manifest(
            JOB,
            f"s3://{bucket}/jobs",
            s3.endpoint,
            env={**FAST_TRAINING, "CTJ_TOTAL_STEPS": "1000000"},  # never done within the run
            scaleUp={"stabilizationSeconds": int(args.stabilization)},
        )
        client.CustomObjectsApi(cluster.api_client()).create_namespaced_custom_object(
            GROUP, VERSION, JOB_NS, PLURAL, manifest
        )
        t0 = time.monotonic()
        _steady(cluster, args.timeout)
        started = time.monotonic() - t0
        log(f"attempt 1 trains at 3 with a commit after {started:.0f}s")
        for i in range(1, args.rounds + 1):
            rounds.append(measure_round(cluster, i, args))
            print(table(rounds[-1:]).splitlines()[-1], flush=True)
    except KeyboardInterrupt:
        log("interrupted: tearing down")
    finally:
        with _no_interrupts():
            if operator is not None:
                operator.kill()
                if args.keep_logs:
                    shutil.copy(operator.log, Path(args.keep_logs) / "operator.log")
            if args.keep_logs:
                for path in (root / "nodes").glob("*/pods/*/*.log"):
                    node_name = path.parents[2].name
                    dest = Path(args.keep_logs) / node_name / path.parent.name
                    dest.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, dest / path.name)
            if s3 is not None:
                s3.stop()
            log("stopping the cluster")
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)
    return rounds, started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="node losses measured (3)")
    parser.add_argument(
        "--node-grace", type=float, default=40.0, help="node-monitor grace period, s (40)"
    )
    parser.add_argument(
        "--node-monitor-period", type=float, default=5.0, help="node-monitor period, s (5)"
    )
    parser.add_argument(
        "--stabilization", type=float, default=10.0, help="scaleUp window for the regrowth (10)"
    )
    parser.add_argument("--settle", type=float, default=3.0, help="s of training before a kill")
    parser.add_argument("--timeout", type=float, default=300.0, help="per wait, s (300)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--keep-logs", help="copy the operator's and the containers' logs here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root: the node agents use mount and UTS namespaces", file=sys.stderr)
        return 2
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    began = time.monotonic()
    rounds, started = run(args)
    if not rounds:
        return 1
    print()
    print(table(rounds))
    print()
    print(breakdown(rounds))
    met = sum(r.target_met for r in rounds)
    print(f"\ntarget kill -> first step <= {TARGET_S:g}s + the restore: met in {met}/{len(rounds)}")
    if args.json:
        report = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "wall_s": round(time.monotonic() - began, 1),
            "first_start_s": round(started, 1),
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "keep_logs")},
            "machine": {
                "nproc": os.cpu_count(),
                "python": platform.python_version(),
                "kernel": platform.release(),
                "loadavg": os.getloadavg(),
            },
            "rounds": [
                {**asdict(r), "lost_steps": r.lost_steps, "stages": r.stages} for r in rounds
            ],
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if met == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
