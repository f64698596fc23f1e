"""The README's main job on a real cluster: the operator surviving a node loss.

Installs the chart and the S3 server, then runs the first steps of the scenario the tests
run (ctj_stack.scenario: the same waits, the same checks): applies the example job, waits
for checkpoints, stops the node under the job's last rank, and prints what happened:
the commits, the failure, the new world size, the restored step, the loss before and
after, the time from the kill to the first step after the restore. Then the node comes
back and the job grows to 3 again. The job is deleted at the end unless --keep.

Every recovery prints its budget: detection, teardown, the new pods' start, imports,
rendezvous, restore, first step (ctj_stack.budget). ``--rounds N --hangs M
--spare-rounds S`` is the recovery benchmark: N node losses (each followed by the node's
return), M hung ranks, and S node losses on a job with a warm spare, with medians and
spreads per phase (docs/benchmarks.md, "Recovery budget").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .budget import format_budget, format_summary, summarize
from .scenario import Lifecycle
from .stack import OPERATOR_NAMESPACE, Images, NodeControl, S3Credentials, Stack

NAMESPACE = "ctj-demo"
JOB = "demo"
SPARE_JOB = "demo-spare"
OPERATOR_RELEASE = "ctj"  # the chart's objects are named ctj, ctj-metrics, ...
OPERATOR_METRICS_PORT = 8080  # the chart's service.port
SIDECAR_METRICS_PORT = 9400  # the operator's builders.METRICS_PORT


def where_to_look(kubeconfig: Path, kubectl_dir: Path) -> str:
    """The closing hints. tests/unit/test_demo_hints.py checks that the Service and ports
    they name exist in the chart as installed here and in the pods the operator builds."""
    operator_ns, service = OPERATOR_NAMESPACE, f"{OPERATOR_RELEASE}-metrics"
    pod_proxy = f"/api/v1/namespaces/{NAMESPACE}/pods/<pod>:{SIDECAR_METRICS_PORT}/proxy/metrics"
    return (
        "\nwhere to look:\n"
        f"  export KUBECONFIG={kubeconfig} PATH={kubectl_dir}:$PATH\n"
        f"  kubectl get ctj -n {NAMESPACE} -w\n"
        f"  kubectl logs -n {NAMESPACE} -l training.ctj.dev/job-name={JOB} -c trainer\n"
        f"  kubectl -n {operator_ns} port-forward svc/{service} {OPERATOR_METRICS_PORT}"
        f"   # then curl localhost:{OPERATOR_METRICS_PORT}/metrics (the operator; the"
        " leader's has the ctj_job_* series)\n"
        f"  kubectl get pods -n {NAMESPACE} -l training.ctj.dev/job-name={JOB}\n"
        f"  kubectl get --raw {pod_proxy}"
        "   # a sidecar's metrics (it listens on the pod IP only: no port-forward)"
    )


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.time()

    def __call__(self, what: str, at: float | None = None) -> None:
        print(f"  t+{(at or time.time()) - self.t0:6.1f}s  {what}", flush=True)


def run(
    stack: Stack,
    keep: bool,
    rounds: int = 1,
    hangs: int = 0,
    out: Path | None = None,
    spare_rounds: int = 0,
) -> None:
    """The scenario the tests run (ctj_stack.scenario), its first three steps, told as a
    timeline; then ``rounds - 1`` more node losses and ``hangs`` hung ranks, each with its
    recovery budget, and their medians and spreads (the recovery benchmark); then, on a
    second job of 2 ranks and a warm spare, ``spare_rounds`` node losses the spare takes."""
    credentials = S3Credentials()
    stack.install_operator(
        release=OPERATOR_RELEASE, control_plane=bool(stack.control_plane_nodes())
    )
    stack.install_s3(credentials)
    stack.job_namespace(NAMESPACE, credentials)
    for earlier in (JOB, SPARE_JOB):
        if stack.children(NAMESPACE, earlier):
            stack.log(f"deleting the demo job {earlier} of an earlier run")
            stack.delete_job(NAMESPACE, earlier)
    scenario = Lifecycle(stack, NAMESPACE, JOB)
    timeline = Timeline()
    print("timeline:", flush=True)
    timeline("applying the example job: 3 replicas, a checkpoint every 10 steps")
    st = scenario.commits_checkpoints()
    rank0 = stack.master(NAMESPACE, JOB, int(st["attempt"])) or ""
    for e in stack.trainer_events(NAMESPACE, rank0):
        if e["event"] == "committed":
            timeline(f"committed step {e['step']} at world 3 ({e['mode']}, "
                     f"{e['uploaded_bytes'] / 1e6:.1f} MB up)", e["t"])  # fmt: skip

    loss = scenario.loses_a_node()
    r, first = loss.restored, loss.first_step
    timeline(f"node {loss.node} stopped (it ran {loss.victim}); last commit: step "
             f"{loss.committed_before}", loss.killed_at)  # fmt: skip
    started = loss.status.get("attemptStarted")  # when the operator made the attempt
    timeline(f"operator restarted the job: attempt {loss.status['attempt']}, world size 2",
             float(started) if started else None)  # fmt: skip
    timeline(f"restored step {r['step']} resharded 3 -> 2 in {r['seconds']:.2f}s "
             f"({r['bytes_fetched'] / 1e6:.1f} MB; by tier {r.get('bytes_by_tier')})",
             r["t"])  # fmt: skip
    same = "==" if loss.staged_loss == r["eval_loss"] else "!="
    timeline(f"eval loss at step {r['step']}: {r['eval_loss']:.5f} after the restore {same} "
             f"{loss.staged_loss} logged when it was saved", r["t"])  # fmt: skip
    recovery = first["t"] - loss.killed_at
    timeline(f"first step after the restore: {first['step']} "
             f"(recovery: {recovery:.1f}s from the kill)", first["t"])  # fmt: skip
    timeline(f"recovery budget: {format_budget(loss.budget())}", first["t"])
    budgets: dict[str, list[dict[str, float | None]]] = {"node_loss": [loss.budget()]}

    timeline(f"starting node {loss.node} again")
    grown, back = scenario.node_returns()
    timeline(f"job grew back to world size 3 (attempt {grown['attempt']}) from step "
             f"{back['step']}")  # fmt: skip
    for i in range(2, rounds + 1):
        again = scenario.loses_a_node()
        budgets["node_loss"].append(again.budget())
        timeline(f"node loss {i}/{rounds}: {format_budget(again.budget())}", again.first_step["t"])
        scenario.node_returns()
    for i in range(1, hangs + 1):
        hang = scenario.hangs_a_rank()
        budgets.setdefault("hung_rank", []).append(hang.budget())
        timeline(f"hung rank {i}/{hangs}: {format_budget(hang.budget())}", hang.first_step["t"])
    if spare_rounds:
        stack.delete_job(NAMESPACE, JOB)  # its 3 nodes: the spare's job needs them
        spared = Lifecycle(stack, NAMESPACE, SPARE_JOB, spec={"replicas": 2, "spares": 1})
        timeline("applying a job of 2 replicas and 1 warm spare (spec.spares)")
        spared.commits_checkpoints()
        for i in range(1, spare_rounds + 1):
            taken = spared.loses_a_node()
            budgets.setdefault("node_loss_spare", []).append(taken.budget())
            timeline(f"node loss {i}/{spare_rounds}, the spare took the rank at world size 2: "
                     f"{format_budget(taken.budget())}", taken.first_step["t"])  # fmt: skip
            spared.node_returns()
        stack.delete_job(NAMESPACE, SPARE_JOB)
    if rounds > 1 or hangs or spare_rounds:
        for fault, found in budgets.items():
            print(f"\n{fault}, {len(found)} rounds:\n{format_summary(summarize(found))}")
    if out is not None:
        summary = {fault: summarize(found) for fault, found in budgets.items()}
        out.write_text(json.dumps({"rounds": budgets, "summary": summary}, indent=1) + "\n")
        print(f"(wrote {out})", flush=True)

    print(where_to_look(stack.kubeconfig, Path(stack.tools.kubectl).parent), flush=True)
    if not keep and stack.children(NAMESPACE, JOB):  # the spare rounds deleted it already
        stack.delete_job(NAMESPACE, JOB)
        print("(the demo job was deleted; --keep leaves it training)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ctj_stack demo", description=__doc__)
    parser.add_argument("--keep", action="store_true", help="leave the job running at the end")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="node losses to recover from (the recovery benchmark: 5+)",
    )
    parser.add_argument(
        "--hangs",
        type=int,
        default=0,
        help="then as many hung ranks (a trainer SIGSTOPped for good)",
    )
    parser.add_argument(
        "--spare-rounds",
        type=int,
        default=0,
        help="then node losses on a job of 2 ranks and 1 warm spare (spec.spares)",
    )
    parser.add_argument("--json", type=Path, help="write every round's budget and the summary")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.hangs < 0 or args.spare_rounds < 0:
        parser.error("--rounds must be at least 1, --hangs and --spare-rounds at least 0")
    kubeconfig = os.environ.get("CTJ_E2E_KUBECONFIG", "")
    nodes = NodeControl.from_env()
    try:
        images = Images.from_env()
    except ValueError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    if not kubeconfig or nodes is None:
        print("demo: needs CTJ_E2E_KUBECONFIG and CTJ_E2E_NODE_STOP/START "
              "(./hack/demo.sh sets them on kind)", file=sys.stderr)  # fmt: skip
        return 2
    stack = Stack(Path(kubeconfig), images, log=lambda line: print(f"demo: {line}", flush=True),
                  nodes=nodes)  # fmt: skip
    run(stack, args.keep, args.rounds, args.hangs, args.json, args.spare_rounds)
    return 0
