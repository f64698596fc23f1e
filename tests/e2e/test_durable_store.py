"""The in-cluster S3 server keeps every checkpoint when its pod goes: deploy/seaweedfs is a
StatefulSet whose data is a PersistentVolumeClaim (on kind, hack/kind/storage.yaml's
local-path provisioner), not an emptyDir that dies with the pod.

While a job trains and has committed checkpoints, the SeaweedFS pod is deleted, as an
eviction, a node drain or `kubectl delete pod` would. Once its replacement is Ready (a
new pod, the same claim, the same volume), every checkpoint committed before is still
listed and verifies (`ctj checkpoints ls` / `verify --all`, the project's CLI, run in the
job's own trainer container where the job's location and credentials are), and the job
commits on, in the same attempt: a store gone for seconds is waited out, not a failure.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from ctj_stack import Stack
from ctj_stack.scenario import NO_STANDBY, TRAINING
from ctj_stack.stack import S3_NAMESPACE, S3_SERVER

JOB = "durable"
WORLD = 2
S3_POD = f"{S3_SERVER}-0"  # the StatefulSet's one pod


def ctj_cli(stack: Stack, namespace: str, *args: str) -> Any:
    """``python -m trainer_sidecar checkpoints ARGS --json <the job's URI>`` in rank 0's
    trainer container (the trainer image has torch, which verify needs; the pod has the
    job's location, endpoint and credentials in its environment, never in a log line).
    Waits for a running attempt: a rank may be between attempts when asked."""
    command = " ".join(["exec python -m trainer_sidecar checkpoints", *args, "--json",
                        '"$CTJ_CHECKPOINT_URI"'])  # fmt: skip

    def run() -> Any:
        st = stack.running(namespace, JOB, WORLD)
        pod = stack.master(namespace, JOB, int(st["attempt"])) if st else None
        if not pod:
            return None
        out = stack.kubectl("exec", "-n", namespace, pod, "-c", "trainer", "--", "sh", "-c",
                            command)  # fmt: skip
        return [json.loads(out)]

    return stack.wait(run, f"`ctj checkpoints {args[0]}` in a running rank 0", 300,
                      lambda: stack.describe(namespace, JOB))[0]  # fmt: skip


def committed_steps(stack: Stack, namespace: str) -> list[int]:
    rows = ctj_cli(stack, namespace, "ls")
    assert all("unreadable" not in r for r in rows), rows
    return [int(r["step"]) for r in rows]


def s3_pod(stack: Stack) -> Any:
    pods = stack.core.list_namespaced_pod(S3_NAMESPACE, field_selector=f"metadata.name={S3_POD}")
    return pods.items[0] if pods.items else None


def ready(pod: Any) -> bool:
    conditions = pod.status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def data_claim(stack: Stack, pod: Any) -> tuple[str, str]:
    """The pod's data claim and the PersistentVolume bound to it."""
    (claim,) = [v.persistent_volume_claim.claim_name for v in pod.spec.volumes
                if v.name == "data" and v.persistent_volume_claim]  # fmt: skip
    pvc = stack.core.read_namespaced_persistent_volume_claim(claim, S3_NAMESPACE)
    return claim, str(pvc.spec.volume_name)


@pytest.fixture
def training_job(
    stack: Stack, operator_installed: str, job_namespace: str
) -> Iterator[dict[str, Any]]:
    """The example job at world size 2, keeping every checkpoint (keepLast 0: none is
    retired while the test reads them), with 3 committed. Deleted at the end."""
    job = stack.example_job(JOB, "pods", **TRAINING, **NO_STANDBY)
    job["spec"].update(replicas=WORLD)
    job["spec"]["checkpoint"]["keepLast"] = 0

    stack.apply_job(job_namespace, job)

    def committed() -> dict[str, Any] | None:
        st = stack.running(job_namespace, JOB, WORLD)
        return st if st and (st.get("lastCheckpoint") or {}).get("step", 0) >= 30 else None

    what = f"{WORLD} pods running, 3 checkpoints committed"
    status: dict[str, Any] = stack.wait(committed, what, 600,
                                        lambda: stack.describe(job_namespace, JOB))  # fmt: skip
    yield status
    stack.delete_job(job_namespace, JOB)
    stack.wait(lambda: not stack.children(job_namespace, JOB), f"every child of {JOB} to go", 180)


def test_deleting_the_s3_pod_keeps_every_committed_checkpoint(
    stack: Stack, job_namespace: str, training_job: dict[str, Any]
) -> None:
    ns, attempt = job_namespace, int(training_job["attempt"])
    before = committed_steps(stack, ns)
    assert len(before) >= 3, before
    old = s3_pod(stack)
    assert old is not None and ready(old), "the S3 server runs before the delete"
    claim, volume = data_claim(stack, old)

    stack.log(f"deleting pod {S3_NAMESPACE}/{S3_POD} (checkpoints committed: {before})")
    deleted_at = time.time()
    stack.kubectl("delete", "pod", "-n", S3_NAMESPACE, S3_POD, "--wait=false")

    def back() -> Any:
        pod = s3_pod(stack)
        return pod if pod and pod.metadata.uid != old.metadata.uid and ready(pod) else None

    def describe() -> str:
        return stack.kubectl("describe", "pod", "-n", S3_NAMESPACE, S3_POD)

    new = stack.wait(back, f"a new {S3_POD} Ready", 300, describe)
    stack.log(f"{S3_POD} Ready again {time.time() - deleted_at:.1f}s after the delete, "
              f"on {new.spec.node_name}")  # fmt: skip
    assert data_claim(stack, new) == (claim, volume), "the new pod mounts the same volume"

    after = committed_steps(stack, ns)
    assert set(before) <= set(after), f"lost with the pod: {sorted(set(before) - set(after))}"
    verdicts = {int(v["step"]): v for v in ctj_cli(stack, ns, "verify", "--all")}
    for step in before:
        assert verdicts[step]["status"] == "ok", verdicts[step]

    # the job commits on: a checkpoint after the last one before the delete (the sidecars
    # retry the store; whether the trainer rode the outage out in the same attempt is
    # logged, not asserted: a save blocked past its backpressure may end the attempt)
    def committed_again() -> dict[str, Any] | None:
        st = stack.status(ns, JOB)
        return st if (st.get("lastCheckpoint") or {}).get("step", 0) > max(after) else None

    st = stack.wait(committed_again, f"a checkpoint after step {max(after)}", 300,
                    lambda: stack.describe(ns, JOB))  # fmt: skip
    stack.log(f"committed on at step {st['lastCheckpoint']['step']}, attempt "
              f"{st['attempt']} (was {attempt})")  # fmt: skip
    assert int(st["lastCheckpoint"]["step"]) in committed_steps(stack, ns)
