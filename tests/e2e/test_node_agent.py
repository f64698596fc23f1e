"""The node tier on a real cluster: the chart's node agents hold a job's chunks on the
nodes its ranks ran on, and a deleted job's data is gone from every node within the
agents' bound (one collection period plus one list: 10 s by default; 30 s asserted).

Each node's cache is read through its agent pod (``kubectl exec`` into the DaemonSet's
pod: the only pod with the hostPath), so this runs on any cluster, not only kind.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from ctj_contract import LABEL_JOB, NODE_CACHE_MOUNT_PATH
from ctj_operator.builders import SIDECAR_NAME
from ctj_stack import Stack
from ctj_stack.scenario import NO_STANDBY, TRAINING

JOB = "agentgc"
WORLD = 2
BOUND_S = 30.0
AGENT_SELECTOR = "app.kubernetes.io/component=node-agent"
MOUNT_PROBE = f"""
import errno, json, os
path = {NODE_CACHE_MOUNT_PATH!r}
real = os.path.realpath(path)  # /var/run is often a link to /run
options = [l.split()[5] for l in open("/proc/self/mountinfo") if l.split()[4] == real]
chunks = sum(len(files) for _, _, files in os.walk(path))
try:
    open(os.path.join(path, "planted"), "wb").close()
    write = "written"
except OSError as exc:
    write = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps({{"options": options[0] if options else "", "chunks": chunks, "write": write}}))
"""


def agent_pods(stack: Stack, operator_namespace: str) -> list[str]:
    out = stack.kubectl(
        "get", "pods", "-n", operator_namespace, "-l", AGENT_SELECTOR,
        "-o", "jsonpath={.items[*].metadata.name}",
    )  # fmt: skip
    return out.split()


def job_dirs(stack: Stack, operator_namespace: str, namespace: str) -> dict[str, list[str]]:
    """Per agent pod: the uid directories of the job on its node."""
    found = {}
    for pod in agent_pods(stack, operator_namespace):
        out = stack.kubectl(
            "exec", "-n", operator_namespace, pod, "-c", "node-agent", "--",
            "sh", "-c", f"ls /cache/{namespace}/{JOB} 2>/dev/null || true",
        )  # fmt: skip
        found[pod] = out.split()
    return found


def sidecar_logs(stack: Stack, namespace: str) -> str:
    """What each of the job's sidecars said about its node agent."""
    pods = stack.kubectl("get", "pods", "-n", namespace, "-l", f"{LABEL_JOB}={JOB}",
                         "-o", "jsonpath={.items[*].metadata.name}").split()  # fmt: skip
    said = []
    for pod in pods:
        log = stack.container_log(namespace, pod, SIDECAR_NAME) or "(no log)"
        said += [f"{pod}: {line}" for line in log.splitlines() if "node agent" in line]
    return "\n".join(said[-40:])


def test_a_deleted_jobs_cache_is_gone_from_every_node_within_the_bound(
    stack: Stack, operator_installed: str, job_namespace: str
) -> None:
    # every agent Ready (one on a node the lifecycle scenario stopped and started again
    # may still be restarting; the one deleted here is made again)
    (daemonset,) = stack.kubectl("get", "daemonset", "-n", operator_installed, "-l",
                                 AGENT_SELECTOR, "-o", "name").split()  # fmt: skip
    # an agent made again on its node (a node restart, an upgrade) finds the directory its
    # own already: its root step must pass then too (it once crash-looped there)
    again = agent_pods(stack, operator_installed)[0]
    stack.kubectl("delete", "pod", "-n", operator_installed, again, "--wait=true")
    try:
        stack.kubectl("rollout", "status", daemonset, "-n", operator_installed, "--timeout=180s")
    except RuntimeError as exc:  # say which agent, on which node, and why
        listed = stack.kubectl("get", "pods", "-n", operator_installed, "-l", AGENT_SELECTOR,
                               "-o", "wide")  # fmt: skip
        described = stack.kubectl("describe", "pods", "-n", operator_installed, "-l",
                                  AGENT_SELECTOR)  # fmt: skip
        raise AssertionError(f"{exc}\n{listed}\n{described[-6000:]}") from None
    pods = agent_pods(stack, operator_installed)
    assert pods, "the chart installed no node agent"
    job = stack.example_job(JOB, "pods", **TRAINING, **NO_STANDBY)
    job["spec"].update(replicas=WORLD)
    stack.apply_job(job_namespace, job)

    def committed() -> dict[str, Any] | None:
        st = stack.running(job_namespace, JOB, WORLD)
        return st if st and (st.get("lastCheckpoint") or {}).get("step", 0) >= 10 else None

    stack.wait(committed, f"{WORLD} pods running, a checkpoint committed", 600,
               lambda: stack.describe(job_namespace, JOB))  # fmt: skip
    uid = stack.kubectl("get", "ctj", "-n", job_namespace, JOB, "-o", "jsonpath={.metadata.uid}")

    def held() -> dict[str, list[str]]:
        found = job_dirs(stack, operator_installed, job_namespace).items()
        return {pod: dirs for pod, dirs in found if dirs}

    # every rank's sidecar gives its node's agent the chunks it saves, in the job's uid dir:
    # by the next saves at the latest (a pod's first request may fail while the policy
    # enforcer learns its address; the sidecar asks again a second later)
    stack.wait(lambda: len(held()) >= WORLD, f"each of {WORLD} nodes' agents to hold {JOB}'s "
               "chunks", 60, lambda: f"{held()}\n{sidecar_logs(stack, job_namespace)}")  # fmt: skip
    assert all(dirs == [uid] for dirs in held().values()), (uid, held())
    # each trainer sees its node's share of the job through its read-only csi volume
    # (the chart's nodeCache.mount): what a restore there reads with pread
    for pod in stack.kubectl("get", "pods", "-n", job_namespace, "-l", f"{LABEL_JOB}={JOB}",
                             "-o", "jsonpath={.items[*].metadata.name}").split():  # fmt: skip
        seen = json.loads(stack.kubectl(
            "exec", "-n", job_namespace, pod, "-c", "trainer", "--", "python", "-c", MOUNT_PROBE,
        ))  # fmt: skip
        assert seen["options"] and "ro" in seen["options"].split(","), (pod, seen)
        assert seen["chunks"] > 0 and seen["write"] == "EROFS", (pod, seen)

    stack.delete_job(job_namespace, JOB)
    stack.wait(lambda: not stack.children(job_namespace, JOB), f"every child of {JOB} to go", 180)
    stack.wait(
        lambda: (
            not stack.kubectl("get", "ctj", "-n", job_namespace, "--ignore-not-found", "-o", "name")
        ),  # fmt: skip
        f"{JOB} gone from the API",
        120,
    )
    gone_at = time.monotonic()

    def removed() -> bool:
        return not any(job_dirs(stack, operator_installed, job_namespace).values())

    stack.wait(removed, f"{JOB}'s cache removed from every node", BOUND_S + 30,
               lambda: str(job_dirs(stack, operator_installed, job_namespace)))  # fmt: skip
    took = time.monotonic() - gone_at
    if took > BOUND_S:
        pytest.fail(f"the cache was removed {took:.0f}s after the job, over {BOUND_S:.0f}s")
