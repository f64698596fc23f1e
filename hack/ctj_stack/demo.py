"""The README's main job on a real cluster: the operator surviving a node loss.

Installs the chart and the S3 server, applies the example job, waits for checkpoints,
stops the node under the job's last rank, and prints what happened: the commits, the
failure, the new world size, the restored step, the loss before and after, the time
from the kill to the first step after the restore. Then the node comes back and the job
grows to 3 again. The job is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from .stack import Images, NodeControl, S3Credentials, Stack

NAMESPACE = "ctj-demo"
JOB = "demo"
TRAINING = {"CTJ_TOTAL_STEPS": "1000000", "CTJ_STEP_DELAY_S": "0.2"}


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.time()

    def __call__(self, what: str, at: float | None = None) -> None:
        print(f"  t+{(at or time.time()) - self.t0:6.1f}s  {what}", flush=True)


def _events(stack: Stack, attempt: int) -> dict[str, list[dict[str, Any]]]:
    return {
        p.metadata.name: stack.trainer_events(NAMESPACE, p.metadata.name)
        for p in stack.attempt_pods(NAMESPACE, JOB, attempt)
    }


def run(stack: Stack, nodes: NodeControl, keep: bool) -> None:
    credentials = S3Credentials()
    stack.install_operator(control_plane=bool(stack.control_plane_nodes()))
    stack.install_s3(credentials)
    stack.job_namespace(NAMESPACE, credentials)
    if stack.children(NAMESPACE, JOB):
        stack.log("deleting the demo job of an earlier run")
        stack.delete_job(NAMESPACE, JOB)
    stack.apply_job(NAMESPACE, stack.example_job(**TRAINING))
    timeline = Timeline()
    print("timeline:", flush=True)
    timeline("job applied: 3 replicas, a checkpoint every 10 steps")

    def two_commits() -> dict[str, Any] | None:
        st = stack.running(NAMESPACE, JOB, 3)
        return st if st and (st.get("lastCheckpoint") or {}).get("step", 0) >= 20 else None

    st = stack.wait(two_commits, "3 pods training, 2 checkpoints committed", 600,
                    lambda: stack.describe(NAMESPACE, JOB))  # fmt: skip
    attempt = int(st["attempt"])
    before = _events(stack, attempt)
    rank0 = next(iter(sorted(before)))
    for e in before[rank0]:
        if e["event"] == "committed":
            timeline(f"committed step {e['step']} at world 3 ({e['mode']}, "
                     f"{e['uploaded_bytes'] / 1e6:.1f} MB up)", e["t"])  # fmt: skip
    victim = stack.victim(NAMESPACE, JOB, attempt)
    node = stack.node_of(victim)
    committed = st["lastCheckpoint"]["step"]
    killed_at = time.time()
    nodes.stop_node(node)
    timeline(f"node {node} stopped (it ran {victim.metadata.name}); last commit: step {committed}")

    st = stack.wait_running(NAMESPACE, JOB, 2, after=attempt)
    timeline(f"operator restarted the job: attempt {st['attempt']}, world size 2")
    r, first = stack.restored(NAMESPACE, JOB, int(st["attempt"]))
    staged = {
        e["step"]: e.get("eval_loss")
        for ev in before.values()
        for e in ev
        if e["event"] == "staged"
    }
    timeline(f"restored step {r['step']} resharded 3 -> 2 in {r['seconds']:.2f}s "
             f"({r['bytes_fetched'] / 1e6:.1f} MB; by tier {r.get('bytes_by_tier')})",
             r["t"])  # fmt: skip
    loss_before = staged.get(r["step"])
    same = "==" if loss_before == r["eval_loss"] else "!="
    timeline(f"eval loss at step {r['step']}: {r['eval_loss']:.5f} after the restore {same} "
             f"{loss_before} logged when it was saved", r["t"])  # fmt: skip
    timeline(f"first step after the restore: {first['step']} "
             f"(recovery: {first['t'] - killed_at:.1f}s from the kill)", first["t"])  # fmt: skip

    started = time.time()
    nodes.start_node(node)
    timeline(f"node {node} started again")
    stack.wait(lambda: stack.node_back(node, started), f"node {node}'s kubelet back", 300)
    grown = stack.wait_running(NAMESPACE, JOB, 3, after=int(st["attempt"]))
    back, _ = stack.restored(NAMESPACE, JOB, int(grown["attempt"]))
    timeline(f"job grew back to world size 3 (attempt {grown['attempt']}) from step "
             f"{back['step']}")  # fmt: skip

    kubeconfig = stack.kubeconfig
    print(
        "\nwhere to look:\n"
        f"  export KUBECONFIG={kubeconfig} PATH={Path(stack.tools.kubectl).parent}:$PATH\n"
        f"  kubectl get ctj -n {NAMESPACE} -w\n"
        f"  kubectl logs -n {NAMESPACE} -l training.ctj.dev/job-name={JOB} -c trainer\n"
        "  kubectl -n ctj-system port-forward svc/ctj 8080   # operator metrics: :8080/metrics\n"
        f"  kubectl -n {NAMESPACE} port-forward pod/<pod> 9400   # a sidecar's metrics",
        flush=True,
    )
    if not keep:
        stack.delete_job(NAMESPACE, JOB)
        print("(the demo job was deleted; --keep leaves it training)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ctj_stack demo", description=__doc__)
    parser.add_argument("--keep", action="store_true", help="leave the job running at the end")
    args = parser.parse_args(argv)
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
    stack = Stack(Path(kubeconfig), images, log=lambda line: print(f"demo: {line}", flush=True))
    run(stack, nodes, args.keep)
    return 0
