"""API requests the operator makes per job per minute at steady state, from the audit log.

The operator is event-driven (docs/operator.md): pods, nodes and Leases reach it through
kopf watches, and the 1 s reconcile timer of a job reads memory, so a job that runs
without change should cost no request at all. What is left is a fixed cost for the whole
operator (the leader Lease, renewed every 2 s; each watch re-opened every
``--watch-timeout``), not a cost per job or per node. This script measures it side by side
over cluster and job counts, in one run.

For each (nodes, jobs) configuration:

* a fresh local cluster (ctj_devcluster, ``ClusterConfig(audit_log=True, nodes=N)``) with
  the CRD, and deploy/operator-rbac.yaml applied;
* the operator as a process on the ``ctj-operator`` ServiceAccount's token (as
  tests/cluster/test_operator_rbac.py runs it), so its requests are exactly those of the
  user ``system:serviceaccount:ctj-system:ctj-operator``; its leader Lease lives in
  ctj-system;
* a moto S3 (``LocalS3``) for the jobs' checkpoint settings;
* J jobs of ``--replicas`` pods (min = max, 1 by default) whose trainer only sleeps; each
  pod still runs the checkpoint sidecar, which the operator asks for a heartbeat every
  second (no API request: the target is at most 1 liveness write per pod per minute).
  Whatever the pods send on their service account (``system:serviceaccount:<namespace>:
  default``) is counted apart, per rank (it was a Lease patch every 2 s before the
  operator asked the sidecars);
* once every job is Running at attempt 1 with its pod Running, ``--settle`` seconds, then
  a window of ``--minutes``: the requests the API server received in it, by user, verb and
  resource (``ctj_devcluster.audit.count``: a watch counts once per watch opened). After
  the window every job must still be at attempt 1 (no restart spoiled the steady state).

Figures are requests per minute of the window: the operator's in all and per job, split
into the leader Lease, watch opens and the rest ("per-job" requests: status writes, pods,
Leases, Events...; zero at steady state is the goal), and the sidecars' per rank. The
ratio line divides the largest configuration's figures by the smallest's: flat (or
falling, as the fixed cost is shared by more jobs) is what the design promises.

Usage:

    source hack/env.sh
    python bench/bench_operator_requests.py                       # 2,4 nodes x 5,20 jobs
    python bench/bench_operator_requests.py --jobs 10,50 --nodes 3,8 --minutes 2
    python bench/bench_operator_requests.py --quick               # 1 small config, ~2 min

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
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Cluster, ClusterConfig, find_binaries
from ctj_devcluster.audit import AuditEvent, count, read_events
from ctj_devcluster.local_s3 import LocalS3
from ctj_stack.jobs import OperatorProcess, install_crd, job_manifest
from kubernetes import client

ROOT = Path(__file__).resolve().parents[1]

RBAC = ROOT / "deploy" / "operator-rbac.yaml"
OPERATOR_NS, OPERATOR_SA = "ctj-system", "ctj-operator"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"
JOB_NS = "bench"
SIDECAR_USER = f"system:serviceaccount:{JOB_NS}:default"
TARGET_PER_JOB_MIN = 10.0
"""The design's bound: at most ~10 operator requests per job per minute at steady state."""
Key = tuple[str, str]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Row:
    nodes: int
    jobs: int
    window_s: float
    operator: dict[str, int]
    """(verb what) -> requests in the window, the operator's user."""
    operator_by_agent: dict[str, dict[str, int]]
    leader: dict[str, int]
    """The subset on the leader Lease."""
    sidecars: dict[str, int]
    operator_cpu_s: float
    ready_after_s: float
    replicas: int = 1
    """Pods per job."""
    restarts_before: int = 0
    """Attempts ended before the window (all causes): the start was not clean."""
    restarted_jobs: list[str] = field(default_factory=list)
    """Jobs whose attempt changed in the window: not a steady state."""
    steady: bool = True
    """Every job ran before the window and none restarted in it."""
    end_state: str = ""

    @property
    def minutes(self) -> float:
        return self.window_s / 60.0

    def operator_per_min(self) -> float:
        return sum(self.operator.values()) / self.minutes

    def leader_per_min(self) -> float:
        return sum(self.leader.values()) / self.minutes

    def watches_per_min(self) -> float:
        watches = sum(n for k, n in self.operator.items() if k.startswith("watch "))
        return watches / self.minutes

    def other_per_min(self) -> float:
        """Neither the leader Lease nor a watch: what the jobs themselves cost."""
        other = Counter(self.operator) - Counter(self.leader)
        return sum(n for k, n in other.items() if not k.startswith("watch ")) / self.minutes

    def operator_per_job_min(self) -> float:
        return self.operator_per_min() / self.jobs

    def other_per_job_min(self) -> float:
        return self.other_per_min() / self.jobs

    def sidecar_per_rank_min(self) -> float:
        return sum(self.sidecars.values()) / self.minutes / (self.jobs * self.replicas)

    def top(self, n: int = 4) -> str:
        """The most frequent requests besides the leader Lease's, per minute."""
        ranked = (Counter(self.operator) - Counter(self.leader)).most_common(n)
        return ", ".join(f"{k} {v / self.minutes:.1f}" for k, v in ranked) or "none"

    def summary(self) -> dict[str, Any]:
        return {
            "operator_req_per_min": self.operator_per_min(),
            "leader_lease_req_per_min": self.leader_per_min(),
            "watch_opens_per_min": self.watches_per_min(),
            "other_req_per_min": self.other_per_min(),
            "operator_req_per_job_min": self.operator_per_job_min(),
            "other_req_per_job_min": self.other_per_job_min(),
            "sidecar_req_per_rank_min": self.sidecar_per_rank_min(),
            "operator_cpu_percent": 100.0 * self.operator_cpu_s / self.window_s,
        }


def _keyed(counts: Counter[Key]) -> dict[str, int]:
    return {f"{verb} {what}": n for (verb, what), n in sorted(counts.items())}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _wait(what: str, timeout: float, check: Any, interval: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _token_kubeconfig(cluster: Cluster, path: Path) -> Path:
    """A kubeconfig with only the operator ServiceAccount's token (no admin cert)."""
    return cluster.service_account_kubeconfig(OPERATOR_NS, OPERATOR_SA, path, duration="2h")


def _prepare(cluster: Cluster, s3: LocalS3) -> None:
    install_crd(cluster)
    cluster.kubectl("create", "namespace", OPERATOR_NS)
    cluster.kubectl("apply", "-f", str(RBAC))
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespace({"metadata": {"name": JOB_NS}})
    _wait(
        "the default service account",
        30,
        lambda: core.list_namespaced_service_account(JOB_NS).items,
        0.2,
    )
    core.create_namespaced_secret(
        JOB_NS,
        {
            "metadata": {"name": "s3-credentials"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": s3.env()["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": s3.env()["AWS_SECRET_ACCESS_KEY"],
            },
        },
    )


def _job_states(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """Every job's status, with ``podPhase``: the phase of its current attempt's pod (two
    list requests, by the admin user: not counted)."""
    api = cluster.api_client()
    jobs = client.CustomObjectsApi(api).list_namespaced_custom_object(
        GROUP, VERSION, JOB_NS, PLURAL
    )["items"]
    pods = client.CoreV1Api(api).list_namespaced_pod(JOB_NS).items
    phases: dict[tuple[str, str], set[str]] = {}
    for pod in pods:
        labels = pod.metadata.labels or {}
        key = (labels.get(f"{GROUP}/job-name", ""), labels.get(f"{GROUP}/attempt", ""))
        phases.setdefault(key, set()).add(pod.status.phase or "")
    states = {}
    for job in jobs:
        name, st = job["metadata"]["name"], dict(job.get("status") or {})
        found = phases.get((name, str(st.get("attempt"))), set())
        st["podPhase"] = found.pop() if len(found) == 1 else ",".join(sorted(found))
        states[name] = st
    return states


def _running(st: dict[str, Any]) -> bool:
    return bool(
        st.get("phase") == "Running" and st.get("podsCreated") and st.get("podPhase") == "Running"
    )


def _describe(states: dict[str, dict[str, Any]]) -> str:
    """Where the jobs are, and why the restarted ones restarted (their Restarted
    condition), as a few lines."""
    where = Counter(
        f"{st.get('phase')}/attempt {st.get('attempt')}/pod {st.get('podPhase') or '-'}"
        for st in states.values()
    )
    why: Counter[str] = Counter()
    example: dict[str, str] = {}
    for name, st in sorted(states.items()):
        for c in st.get("conditions") or []:
            if c.get("type") == "Restarted":
                why[c.get("reason", "")] += 1
                example.setdefault(c.get("reason", ""), f"{name}: {c.get('message', '')}")
    lines = [f"  jobs: {dict(where)}"]
    lines += [f"  last restart {reason} x{n}, e.g. {example[reason]}" for reason, n in why.items()]
    return "\n".join(lines)


class OperatorExited(RuntimeError):
    """The operator process ended during a measurement (e.g. it lost its leader Lease)."""


def _alive(operator: OperatorProcess) -> bool:
    """True, or raises OperatorExited with the end of its log."""
    if operator.proc.poll() is None:
        return True
    tail = "\n".join(operator.log.read_text().splitlines()[-5:])
    raise OperatorExited(f"the operator exited ({operator.proc.returncode}):\n{tail}")


def _create_jobs(
    cluster: Cluster,
    names: list[str],
    bucket: str,
    endpoint: str,
    replicas: int = 1,
    heartbeat_timeout: float | None = None,
) -> None:
    """Jobs of ``replicas`` pods whose trainer only sleeps (each sidecar runs and answers
    the operator's heartbeats), with failureDetection.heartbeatTimeoutSeconds
    ``heartbeat_timeout`` where given (else the example's)."""
    custom = client.CustomObjectsApi(cluster.api_client())
    for name in names:
        manifest = job_manifest(
            name,
            f"s3://{bucket}/jobs",
            endpoint,
            command=["sleep", "100000"],
            replicas=replicas,
            minReplicas=replicas,
            maxReplicas=replicas,
        )
        if heartbeat_timeout is not None:
            detection = manifest["spec"].setdefault("failureDetection", {})
            detection["heartbeatTimeoutSeconds"] = heartbeat_timeout
        custom.create_namespaced_custom_object(GROUP, VERSION, JOB_NS, PLURAL, manifest)


def _leader_events(events: list[AuditEvent], lease: str) -> list[AuditEvent]:
    """The requests on the operator's leader Lease (one per 2 s renewal step, whatever
    the number of jobs)."""
    return [
        e
        for e in events
        if e.resource == "leases" and e.namespace == OPERATOR_NS and e.name == lease
    ]


def measure(nodes: int, jobs: int, args: argparse.Namespace) -> Row:
    root = Path(tempfile.mkdtemp(prefix=f"ctj-bench-requests-n{nodes}-j{jobs}-"))
    config = ClusterConfig(root=root, nodes=nodes, audit_log=True, node_cpu=args.node_cpu,
                           node_memory=args.node_memory)  # fmt: skip
    cluster = Cluster(config, find_binaries())
    s3: LocalS3 | None = None
    operator: OperatorProcess | None = None
    try:
        log(f"{nodes} nodes, {jobs} jobs: starting the cluster in {root}")
        cluster.start()
        s3 = LocalS3.start()
        bucket = f"ctj-bench-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(bucket)
        _prepare(cluster, s3)
        kubeconfig = _token_kubeconfig(cluster, root / "operator.kubeconfig")
        operator = OperatorProcess(
            cluster,
            root / "operator.log",
            kubeconfig,
            extra_args=(
                "--leader-election-namespace",
                OPERATOR_NS,
                "--watch-timeout",
                f"{args.watch_timeout:g}",
            ),
            lease="ctj-operator",  # the one Lease deploy/operator-rbac.yaml lets it renew
        )
        operator.start()
        names = [f"job-{i:03d}" for i in range(jobs)]
        created = time.monotonic()
        steady = True
        for first in range(0, jobs, args.batch):
            _create_jobs(cluster, names[first : first + args.batch], bucket, s3.endpoint,
                         args.replicas, args.heartbeat_timeout)  # fmt: skip
            made = min(jobs, first + args.batch)
            log(f"{made}/{jobs} jobs created; waiting until each runs with its pod Running")
            try:
                _wait(
                    "every job Running with its pod Running",
                    args.ready_timeout + 5.0 * args.batch,
                    lambda: _alive(operator) and all(map(_running, _job_states(cluster).values())),
                )
            except TimeoutError:
                log(f"not every job runs: measuring anyway\n{_describe(_job_states(cluster))}")
                steady = False
                break
        ready_after = time.monotonic() - created
        if steady:
            log(f"all Running after {ready_after:.0f}s; settling {args.settle:g}s")
            time.sleep(args.settle)
        else:  # count the requests of what it does instead: a figure too
            _create_jobs(cluster, names[made:], bucket, s3.endpoint, args.replicas,
                         args.heartbeat_timeout)  # fmt: skip
        before = _job_states(cluster)
        if any(int(st.get("attempt") or 1) > 1 for st in before.values()):
            log(f"restarted before the window:\n{_describe(before)}")
        since = dt.datetime.now(dt.UTC)
        cpu0 = _cpu_seconds(operator.proc.pid)
        log(f"measuring {args.minutes:g} min")
        time.sleep(args.minutes * 60)
        until = dt.datetime.now(dt.UTC)
        _alive(operator)
        cpu1 = _cpu_seconds(operator.proc.pid)
        after = _job_states(cluster)
        restarted = sorted(n for n in names if after[n].get("attempt") != before[n].get("attempt"))
        if restarted or not all(map(_running, after.values())):
            log(f"WARNING: jobs restarted in the window: {restarted}\n{_describe(after)}")
            steady = False
        time.sleep(3)  # a request's audit event is written as it completes
        events = read_events(cluster.audit_log_path)
        leader = _leader_events(events, operator.lease)
        ours = count(events, user=OPERATOR_USER, since=since, until=until)
        agents = sorted({e.user_agent for e in events if e.user == OPERATOR_USER})
        by_agent = {
            agent: _keyed(
                count(
                    (e for e in events if e.user_agent == agent),
                    user=OPERATOR_USER,
                    since=since,
                    until=until,
                )
            )
            for agent in agents
        }
        return Row(
            nodes=nodes,
            jobs=jobs,
            replicas=args.replicas,
            window_s=(until - since).total_seconds(),
            operator=_keyed(ours),
            operator_by_agent={a: c for a, c in by_agent.items() if c},
            leader=_keyed(count(leader, user=OPERATOR_USER, since=since, until=until)),
            sidecars=_keyed(count(events, user=SIDECAR_USER, since=since, until=until)),
            operator_cpu_s=cpu1 - cpu0,
            ready_after_s=ready_after,
            restarts_before=sum(int(st.get("attempt") or 1) - 1 for st in before.values()),
            restarted_jobs=restarted,
            steady=steady,
            end_state=_describe(after),
        )
    finally:
        with _no_interrupts():
            if operator is not None:
                operator.kill()
                if args.keep_logs:
                    shutil.copy(
                        operator.log, Path(args.keep_logs) / f"operator-n{nodes}-j{jobs}.log"
                    )
            if s3 is not None:
                s3.stop()
            log("stopping the cluster")
            cluster.stop()
            if args.keep_logs and cluster.audit_log_path.exists():
                shutil.copy(
                    cluster.audit_log_path, Path(args.keep_logs) / f"audit-n{nodes}-j{jobs}.log"
                )
            shutil.rmtree(root, ignore_errors=True)


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


def _table(rows: list[Row]) -> str:
    head = (
        "| nodes | jobs | window s | operator req/min | leader Lease /min | watch opens /min "
        "| other /min | operator req/job/min | other req/job/min | sidecar req/rank/min "
        "| operator CPU % | restarts before / in window "
        "| top besides the leader Lease (verb resource /min) |"
    )
    lines = [head, "|" + " ---: |" * 12 + " --- |"]
    for r in rows:
        s = r.summary()
        lines.append(
            f"| {r.nodes} | {r.jobs} | {r.window_s:.0f} | {s['operator_req_per_min']:.1f} "
            f"| {s['leader_lease_req_per_min']:.1f} | {s['watch_opens_per_min']:.1f} "
            f"| {s['other_req_per_min']:.1f} | {s['operator_req_per_job_min']:.2f} "
            f"| {s['other_req_per_job_min']:.2f} | {s['sidecar_req_per_rank_min']:.1f} "
            f"| {s['operator_cpu_percent']:.0f} | {r.restarts_before} / {len(r.restarted_jobs)}"
            f"{'' if r.steady else ' NOT steady'} "
            f"| {r.top()} |"
        )
    return "\n".join(lines)


def _ratio(big: float, small: float) -> float | None:
    return big / small if small else None


def _extremes(rows: list[Row]) -> tuple[Row, Row]:
    """The smallest and the largest configuration (nodes x jobs)."""
    size = lambda r: (r.nodes * r.jobs, r.jobs)  # noqa: E731
    return min(rows, key=size), max(rows, key=size)


def _ratios(rows: list[Row]) -> dict[str, float | None]:
    small, big = _extremes(rows)
    a, b = big.summary(), small.summary()
    return {
        f"{name}_largest_over_smallest": _ratio(a[name], b[name])
        for name in (
            "operator_req_per_job_min",
            "other_req_per_job_min",
            "operator_req_per_min",
            "sidecar_req_per_rank_min",
        )
    }


def _commit() -> str:
    """The checkout measured: HEAD, with "+dirty" if operator/ has uncommitted changes."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    dirty = git("status", "--porcelain", "--", "operator").strip()
    return git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if dirty else "")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=_ints, default=[2, 4], help="comma-separated (2,4)")
    parser.add_argument("--jobs", type=_ints, default=[5, 20], help="comma-separated (5,20)")
    parser.add_argument("--replicas", type=int, default=1, help="pods per job (1)")
    parser.add_argument(
        "--node-cpu", default="4", help="each simulated node's advertised CPUs (4; a pod asks 1+)"
    )
    parser.add_argument("--node-memory", default="8Gi", help="and memory (8Gi; a pod asks 1Gi+)")
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        help="the jobs' failureDetection.heartbeatTimeoutSeconds (the example's 3): every "
        "pod's processes share this machine's cores, which a real node's pod does not",
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="measured window (1)")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds before it (30)")
    parser.add_argument(
        "--watch-timeout", type=float, default=60.0, help="the operator's (its default, 60)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=10,
        help="jobs created at once, each batch running before the next (10)",
    )
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="+5 s per job")
    parser.add_argument("--quick", action="store_true", help="2 nodes, 3 jobs, 0.5 min")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--keep-logs", help="copy each run's audit and operator log here")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.jobs, args.minutes, args.settle = [2], [3], 0.5, 15.0
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        print("needs root: the node agents use mount and UTS namespaces", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    began = time.monotonic()
    rows: list[Row] = []
    failed: list[str] = []
    try:
        for nodes in args.nodes:
            for jobs in args.jobs:
                try:
                    rows.append(measure(nodes, jobs, args))
                except OperatorExited as exc:  # a figure of its own: the next config still runs
                    failed.append(f"{nodes} nodes x {jobs} jobs: {exc}")
                    log(failed[-1])
                    continue
                print(_table(rows[-1:]).splitlines()[-1], flush=True)
    except KeyboardInterrupt:
        log("interrupted: torn down")
    for line in failed:
        print(f"NOT MEASURED, {line}")
    if not rows:
        return 1 if failed else 130
    print()
    print(_table(rows))
    ratios = _ratios(rows) if len(rows) > 1 else {}
    print()
    if ratios:
        small, big = _extremes(rows)
        print(f"ratios: {big.nodes} nodes x {big.jobs} jobs / {small.nodes} x {small.jobs}")
        if not (small.steady and big.steady):
            print("  (not both steady: these divide a restart storm's figures, see below)")
    for name, value in ratios.items():
        print(f"{name}: {'n/a (0 in the smallest)' if value is None else f'{value:.2f}'}")
    for r in rows:
        per_job = r.operator_per_job_min()
        verdict = "within" if per_job <= TARGET_PER_JOB_MIN else "ABOVE"
        print(
            f"{r.nodes} nodes x {r.jobs} jobs: {per_job:.2f} operator req/job/min, {verdict} "
            f"~{TARGET_PER_JOB_MIN:g}; per-job (not leader, not watch) {r.other_per_job_min():.2f}"
            + (f"; restarted in the window: {len(r.restarted_jobs)}" if r.restarted_jobs else "")
        )
        if not r.steady:
            print(f"  NOT a steady state, the jobs at the end:\n{r.end_state}")
    if args.json:
        report = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "wall_s": round(time.monotonic() - began, 1),
            "commit": _commit(),
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "keep_logs")},
            "machine": {
                "nproc": os.cpu_count(),
                "python": platform.python_version(),
                "kernel": platform.release(),
            },
            "rows": [{**asdict(r), **r.summary()} for r in rows],
            "ratios": ratios,
            "not_measured": failed,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
