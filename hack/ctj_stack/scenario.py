"""One job through what ctj is bought for, written once for any cluster harness: the
cluster tier runs it on simulated nodes (tests/cluster/test_operator_lifecycle.py), the
e2e tier on kind (tests/e2e/test_job_lifecycle.py).

The job commits checkpoints; the node under one of its ranks is lost and it restarts at
world size 2 from its last checkpoint, resharded; the node comes back and the job grows
to 3; `kubectl scale` resizes it; deleting it removes every child. Each step waits on what
a user would watch (`kubectl get ctj`, the trainer's log), checks what ctj promises at
that point, and returns what it saw, for the tier's own checks and for the record.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ctj_contract import LABEL_RANK, LABEL_SPARE

from .budget import format_budget, recovery_budget
from .harness import Harness

# Long enough never to finish during a scenario; slow enough to read, fast enough to save
# every few seconds (the example saves every 10 steps).
TRAINING = {"CTJ_TOTAL_STEPS": "1000000", "CTJ_STEP_DELAY_S": "0.2"}
# No launcher standby (the example's CTJ_PRELOAD: a second Python process in every pod that
# imports torch ahead of a restart in place), for the trainer's variables of a job whose
# workers are never restarted in place: a controller's backend recreates its pods, and the
# store, queue and network tests restart nothing. There it is only CPU, which the test
# tiers share on 2 cores. The pods backend's lifecycle and the warm spare keep it.
NO_STANDBY = {"CTJ_PRELOAD": ""}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return {c["type"]: c for c in status.get("conditions") or []}.get(kind, {})


def kubectl_wait(cluster: Harness, namespace: str, name: str, *conditions: str) -> None:
    """``kubectl wait --for=condition=...`` on the job, each in turn, as a user or a GitOps
    tool follows it: it returns only once the condition holds for the job's current
    generation (kubectl compares the condition's observedGeneration)."""
    for cond in conditions:
        cluster.kubectl("wait", f"ctj/{name}", "-n", namespace, f"--for=condition={cond}",
                        "--timeout=60s")  # fmt: skip


def assert_standard_conditions(cluster: Harness, namespace: str, name: str) -> None:
    """A running job as standard tooling reads it: Running True, the other phases False,
    and status and every condition observed at the job's generation."""
    job = cluster.job(namespace, name)
    st, generation = job.get("status") or {}, job["metadata"]["generation"]
    states = {c["type"]: c["status"] for c in st.get("conditions") or []}
    assert states.get("Running") == "True", st.get("conditions")
    for kind in ("Queued", "Restarting", "Succeeded", "Failed"):
        assert states.get(kind, "False") == "False", st.get("conditions")
    assert st.get("observedGeneration") == generation, (st.get("observedGeneration"), generation)
    assert all(c.get("observedGeneration") == generation for c in st["conditions"]), st


@dataclass
class NodeLoss:
    """What the node-loss step saw."""

    node: str
    victim: str  # the pod on it
    killed_at: float  # time.time()
    committed_before: int  # the last committed step `kubectl get ctj` showed
    status: dict[str, Any]  # the job's once it ran again at 2
    restored: dict[str, Any]  # rank 0's `restored` event
    first_step: dict[str, Any]  # and its first step after it
    staged_loss: float | None  # the eval loss logged when the restored step was saved
    recovery: dict[str, Any] = field(default_factory=dict)  # the job's status.lastRecovery

    def budget(self) -> dict[str, float | None]:
        return recovery_budget(self.killed_at, self.recovery, self.restored, self.first_step)

    def record(self, backend: str) -> dict[str, Any]:
        """The numbers docs/e2e.md quotes."""
        return {
            "budget": self.budget(),
            "scenario": "node_loss",
            "backend": backend,
            "kill_to_first_step_s": round(self.first_step["t"] - self.killed_at, 1),
            "restored_step": self.restored["step"],
            "committed_before_kill": self.committed_before,
            "restore_seconds": self.restored["seconds"],
            "bytes_by_tier": self.restored.get("bytes_by_tier"),
            "loss_before": self.staged_loss,
            "loss_after": self.restored["eval_loss"],
        }


@dataclass
class Lifecycle:
    """The steps, in order, on one job ``name`` in ``namespace`` run by ``backend``;
    ``training``: the trainer's variables; ``spec``: fields that replace the example's
    (a shorter scale-up window where waiting it out shows nothing); ``example``: the
    manifest under examples/ (job-torchrun.yaml runs several ranks per pod)."""

    cluster: Harness
    namespace: str
    name: str
    backend: str = "pods"
    example: str = "job.yaml"
    training: dict[str, str] = field(default_factory=lambda: dict(TRAINING))
    spec: dict[str, Any] = field(default_factory=dict)
    ranks_per_pod: int = 1  # the example's nprocPerNode: world sizes below count pods
    attempt: int = 0  # the attempt running after the last step
    lost_node: str = ""
    committed_at_delete: int = 0

    @property
    def world(self) -> int:
        """The job's replicas (the example's 3 unless ``spec`` says otherwise)."""
        return int(self.spec.get("replicas", 3))

    @property
    def spares(self) -> int:
        return int(self.spec.get("spares", 0))

    def _spares_running(self) -> list[Any]:
        """The job's warm spares running, by name (the order the operator takes them in)."""
        found = [
            p
            for p in self.cluster.pods(self.namespace, self.name)
            if (p.metadata.labels or {}).get(LABEL_SPARE) == "true"
            and p.status.phase == "Running"
            and not p.metadata.deletion_timestamp
        ]
        return sorted(found, key=lambda p: str(p.metadata.name))

    def _spares_warm(self) -> list[Any]:
        """Waits for spec.spares warm spares Running and counted in status; them."""
        c, ns, name = self.cluster, self.namespace, self.name

        def warm() -> list[Any] | None:
            found = self._spares_running()
            counted = c.status(ns, name).get("spares") == self.spares
            return found if len(found) == self.spares and counted else None

        found: list[Any] = c.wait(warm, f"{self.spares} warm spares running", 300,
                                  lambda: c.describe(ns, name))  # fmt: skip
        return found

    @property
    def in_place(self) -> bool:
        """Survivors restart in place (docs/operator.md): backend pods, and the example's
        trainer command wrapped by the launcher, unless the spec turns it off."""
        policy = self.spec.get("restartPolicy") or {}
        return self.backend == "pods" and policy.get("inPlace", True) is not False

    def _kept_in_place(self, before: list[Any], lost: str, spares: Sequence[Any] = ()) -> None:
        """The survivors of a lost node kept their pods (same UID) and their containers
        were never restarted (the launcher restarted the worker); the next attempt carries
        them as its lowest ranks, in their old order, then the ``spares`` it took."""
        c, ns, name = self.cluster, self.namespace, self.name
        survivors = sorted((p for p in before if p.metadata.name != lost),
                           key=lambda p: int(p.metadata.labels[LABEL_RANK]))  # fmt: skip
        survivors += list(spares)
        now = {p.metadata.name: p for p in c.attempt_pods(ns, name, self.attempt)}
        for rank, old in enumerate(survivors):
            kept = now.get(old.metadata.name)
            assert kept is not None, f"survivor {old.metadata.name} was not kept: {sorted(now)}"
            assert kept.metadata.uid == old.metadata.uid, f"{old.metadata.name} was recreated"
            assert kept.metadata.labels[LABEL_RANK] == str(rank), kept.metadata.labels
            assert LABEL_SPARE not in kept.metadata.labels, f"{old.metadata.name} still a spare"
            restarts = {s.name: s.restart_count for s in kept.status.container_statuses or []}
            assert set(restarts.values()) == {0}, f"{old.metadata.name} restarted: {restarts}"
        carried = c.status(ns, name).get("carried") or []
        assert carried == [p.metadata.name for p in survivors], carried
        c.log(f"survivors kept their pods: {', '.join(carried)}")

    def _last_committed(self) -> int:
        return int((self.cluster.status(self.namespace, self.name).get("lastCheckpoint")
                    or {}).get("step", 0))  # fmt: skip

    def _resumed(
        self, world: int, not_before: int
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Waits for an attempt after the current one to run at ``world`` and restore;
        checks it restored a step at or after ``not_before`` (the last one reported
        committed: nothing committed is lost) and trains on from it. Returns the status,
        the restored event and the first step after it."""
        c, ns = self.cluster, self.namespace
        st = c.wait_running(ns, self.name, world, after=self.attempt)
        kubectl_wait(c, ns, self.name, "Running", "Restarting=false")
        assert_standard_conditions(c, ns, self.name)
        restored, first = c.restored(ns, self.name, int(st["attempt"]))
        assert restored["world_size"] == world * self.ranks_per_pod, restored
        assert restored.get("local_world_size", 1) == self.ranks_per_pod, restored
        assert restored["step"] >= not_before, f"step {not_before} was committed, then lost"
        assert first["step"] == restored["step"] + 1, "training goes on from the checkpoint"
        self.attempt = int(st["attempt"])
        return st, restored, first

    def _restart_counts(self) -> tuple[int, int]:
        """(status.nodeRestarts, status.restarts) now."""
        st = self.cluster.status(self.namespace, self.name)
        return int(st.get("nodeRestarts", 0)), int(st.get("restarts", 0))

    def _recovery_since(self, failed_at: float) -> dict[str, Any]:
        """The job's status.lastRecovery of a failure caused at ``failed_at`` (the operator
        writes it once every rank of the next attempt runs)."""

        def recovered() -> dict[str, Any] | None:
            found = self.cluster.status(self.namespace, self.name).get("lastRecovery") or {}
            return found if found.get("failureSeenAt", 0.0) >= failed_at else None

        found: dict[str, Any] = self.cluster.wait(recovered, "status.lastRecovery", 60)
        return found

    def commits_checkpoints(self) -> dict[str, Any]:
        """Applies the example job; 3 pods run and 2 checkpoints commit. Its status."""
        c, ns, name = self.cluster, self.namespace, self.name
        job = c.example_job(name, self.backend, self.example, **self.training)
        job["spec"].update(self.spec)
        self.ranks_per_pod = int(job["spec"].get("nprocPerNode", 1))
        c.apply_job(ns, job)

        def committed() -> dict[str, Any] | None:
            st = c.running(ns, name, self.world)
            return st if st and (st.get("lastCheckpoint") or {}).get("step", 0) >= 20 else None

        what = f"{self.world} pods running, a checkpoint committed"
        st: dict[str, Any] = c.wait(committed, what, 600, lambda: c.describe(ns, name))
        last = st["lastCheckpoint"]
        assert last["step"] % 10 == 0 and last["bytes"] > 0, last
        table = c.kubectl("get", "ctj", name, "-n", ns).splitlines()
        header = table[0].split()
        row = dict(zip(header, table[1].split(), strict=False))
        assert "STEP" in header and int(row["STEP"]) >= last["step"], table
        assert row["PHASE"] == "Running" and row["WORLD"] == str(self.world), table
        kubectl_wait(c, ns, name, "Running", "Queued=false")
        assert_standard_conditions(c, ns, name)
        owners = {  # the controllers' pods: of our PyTorchJob, or of our TrainJob's Job
            "pytorchjob": ("PyTorchJob", f"{name}-a{st['attempt']}"),
            "trainjob": ("Job", f"{name}-a{st['attempt']}-node-0"),
        }
        if self.backend in owners:
            for pod in c.attempt_pods(ns, name, st["attempt"]):
                (owner,) = pod.metadata.owner_references
                assert (owner.kind, owner.name) == owners[self.backend], owner
        self.attempt = int(st["attempt"])
        if self.spares:
            self._spares_warm()
        return st

    def _crash_operator_once_seen(self, since: float) -> None:
        """Waits for the operator to see a failure caused at ``since`` and kills it then,
        mid-recovery: before the next attempt runs (status.lastRecovery is written once
        it does)."""
        c, ns, name = self.cluster, self.namespace, self.name

        def recovered(st: dict[str, Any]) -> bool:
            return bool((st.get("lastRecovery") or {}).get("failureSeenAt", 0.0) >= since)

        def seen() -> bool:
            st = c.status(ns, name)
            return (st.get("failureSeenAt") or 0.0) >= since or recovered(st)

        c.wait(seen, "the operator to see the failure", 120, poll=0.05)
        leader = c.crash_operator()
        assert not recovered(c.status(ns, name)), "the recovery ended before the operator died"
        c.log(f"killed the operator {leader} mid-recovery")

    def loses_a_node(self, crash_operator: bool = False) -> NodeLoss:
        """Stops the node of one rank (not rank 0's where it can); the job restarts one
        smaller on the nodes left (with a warm spare: at the same size, the spare taking
        the lost rank, nothing resharded), from a checkpoint at or after the last one
        reported committed, and the restored model computes the loss the saved one did.
        ``crash_operator``: the leading operator is killed once it has seen the failure;
        the recovery is finished by its successor, the failure counted once."""
        c, ns, name = self.cluster, self.namespace, self.name
        pods = c.attempt_pods(ns, name, self.attempt)
        warm = self._spares_warm() if self.spares else []
        victim = c.victim(ns, name, self.attempt)
        node = c.node_of(victim)
        committed_before = self._last_committed()
        counts = self._restart_counts()
        before = {p.metadata.name: c.trainer_events(ns, p.metadata.name) for p in pods}
        killed_at = time.time()
        c.log(f"stopping node {node} (it runs {victim.metadata.name})")
        c.stop_node(node)
        self.lost_node = node
        if crash_operator:
            self._crash_operator_once_seen(killed_at)

        after = self.world if warm else self.world - 1
        st, restored, first = self._resumed(after, committed_before)
        node_restarts, restarts = counts
        assert (st["nodeRestarts"], st.get("restarts", 0)) == (node_restarts + 1, restarts), (
            "a lost node is not a crash"
        )
        reason = condition(st, "Restarted").get("reason")
        assert reason in ("HeartbeatLost", "NodeNotReady"), st["conditions"]
        for pod in c.attempt_pods(ns, name, self.attempt):
            assert c.node_of(pod) != node, f"{pod.metadata.name} is on the lost node"
        if self.in_place:
            self._kept_in_place(pods, victim.metadata.name, warm[:1])
        if warm:
            saved = restored["saved_world_size"]
            assert saved == restored["world_size"], f"resharded {saved} -> {restored}"
        staged = {
            e["step"]: e["eval_loss"]
            for events in before.values()
            for e in events
            if e["event"] == "staged" and "eval_loss" in e
        }
        loss = staged.get(restored["step"])
        if loss is not None:  # else staged in the instant between the log read and the kill
            assert math.isclose(restored["eval_loss"], loss, rel_tol=1e-4), (restored, loss)
        recovery = self._recovery_since(killed_at)
        assert recovery["reason"] == reason, (recovery, reason)
        loss_seen = NodeLoss(node, victim.metadata.name, killed_at, committed_before, st,
                             restored, first, loss, recovery)  # fmt: skip
        c.log(f"node loss, kill to first step: {format_budget(loss_seen.budget())}")
        return loss_seen

    def node_returns(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Starts the lost node again; the job grows back to 3 (planned: not a failure).
        With spares, the job never shrank: a new spare runs there instead, and nothing
        restarts. The status and the restored event (None with spares)."""
        c, ns, node = self.cluster, self.namespace, self.lost_node
        counts = self._restart_counts()
        started = time.time()
        c.start_node(node)
        c.wait(lambda: c.node_back(node, started), f"node {node}'s kubelet back", 300)
        if self.spares:
            self._spares_warm()
            st = c.status(ns, self.name)
            assert int(st["attempt"]) == self.attempt, "a spare made is no restart"
            return st, {}
        st, restored, _ = self._resumed(self.world, self._last_committed())
        assert self._restart_counts() == counts, "growing is not a failure"
        assert condition(st, "Restarted").get("reason") == "ScaleUp", st["conditions"]
        assert "ScaleUp" in {e.reason for e in c.events(ns, self.name)}
        return st, restored

    def resized(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """`kubectl scale` to the other size (2 or 3); the job restarts at it from its
        last checkpoint, as a Resize, not a failure. The status and the restored event."""
        c, ns = self.cluster, self.namespace
        world = 2 if c.status(ns, self.name)["worldSize"] == 3 else 3
        restarts = int(c.status(ns, self.name).get("restarts", 0))
        committed = self._last_committed()
        c.scale(ns, self.name, world)
        st, restored, _ = self._resumed(world, committed)
        assert st["restarts"] == restarts, "a resize is not a failure"
        assert condition(st, "Restarted").get("reason") == "Resize", st["conditions"]
        assert "Resize" in {e.reason for e in c.events(ns, self.name)}
        return st, restored

    def suspended_and_resumed(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """spec.suspend true: the attempt checkpoints at a step boundary, every pod goes and
        the job waits Suspended, counted nowhere; false again, with replicas at the other
        size (2 or 3): the next attempt restores that checkpoint, resharded. The status
        while suspended and the restored event."""
        c, ns = self.cluster, self.namespace
        world = 2 if c.status(ns, self.name)["worldSize"] == 3 else 3
        counts = self._restart_counts()
        c.suspend(ns, self.name, True)
        kubectl_wait(c, ns, self.name, "Suspended")
        st = c.status(ns, self.name)
        assert st["phase"] == "Suspended" and self._restart_counts() == counts, st
        said = condition(st, "Suspended").get("message", "")
        assert "checkpointed and stopped" in said, st["conditions"]
        c.wait(lambda: not c.pods(ns, self.name), "every pod of the suspended job gone", 60)
        assert "startTime" not in st, "the deadline counts again from the resume"
        committed = self._last_committed()
        c.suspend(ns, self.name, False, replicas=world)
        _, restored, _ = self._resumed(world, committed)
        assert self._restart_counts() == counts, "a suspend is not a failure"
        assert condition(c.status(ns, self.name), "Suspended").get("status") == "False"
        return st, restored

    def _steps(self, pod: str) -> list[int]:
        events = self.cluster.trainer_events(self.namespace, pod)
        return [int(e["step"]) for e in events if e.get("event") == "step"]

    def pauses_a_rank(self, seconds: float) -> dict[str, Any]:
        """Stops one rank's trainer (SIGSTOP) for ``seconds``, less than the heartbeat
        timeout, and lets it go on (SIGCONT): training goes on past the pause in the same
        attempt, nothing restarted (a long GC pause, a stalled disk). The status."""
        c, ns, name = self.cluster, self.namespace, self.name
        before = c.status(ns, name)
        master = c.master(ns, name, self.attempt)
        assert master, f"attempt {self.attempt} has no rank-0 pod"
        victim = c.victim(ns, name, self.attempt).metadata.name
        step = c.wait(lambda: self._steps(master), "a step of rank 0", 60)[-1]
        c.log(f"stopping the trainer of {victim} for {seconds:g} s")
        c.signal_trainer(ns, victim, "STOP")
        try:
            time.sleep(seconds)  # the fault itself: a pause of this length
        finally:
            c.signal_trainer(ns, victim, "CONT")
        # steps are collective: rank 0 past the pause means every rank went on, and the
        # operator has asked every rank several times since
        c.wait(lambda: self._steps(master)[-1] >= step + 30, "training past the pause", 120)
        st = c.status(ns, name)
        for key in ("attempt", "restarts", "nodeRestarts"):
            assert st.get(key, 0) == before.get(key, 0), (key, before, st)
        return st

    def hangs_a_rank(self) -> NodeLoss:
        """Stops one rank's trainer for good (SIGSTOP): its sidecar still answers, the
        operator sees the trainer silent past the heartbeat timeout and restarts the job
        (RankHung, the job's own failure) at the same size, from its last checkpoint; the
        stopped pod is deleted by force. What it saw, as a node loss's record."""
        c, ns, name = self.cluster, self.namespace, self.name
        world = int(c.status(ns, name)["worldSize"])
        node_restarts, restarts = self._restart_counts()
        pods = c.attempt_pods(ns, name, self.attempt)
        victim = c.victim(ns, name, self.attempt)
        committed_before = self._last_committed()
        stopped_at = time.time()
        c.log(f"stopping the trainer of {victim.metadata.name} (SIGSTOP)")
        c.signal_trainer(ns, victim.metadata.name, "STOP")
        st, restored, first = self._resumed(world, committed_before)
        restarted = condition(st, "Restarted")
        assert restarted.get("reason") == "RankHung", st["conditions"]
        rank = victim.metadata.labels[LABEL_RANK]
        assert f"trainer of rank {rank}" in restarted.get("message", ""), restarted
        assert self._restart_counts() == (node_restarts, restarts + 1), (
            "a hung rank is the job's failure, not a node's"
        )
        assert not st.get("suspectNodes"), "the node of a hung trainer is not suspect"
        if self.in_place:  # the others restarted in place; the stuck pod was replaced
            self._kept_in_place(pods, victim.metadata.name)
        recovery = self._recovery_since(stopped_at)
        hang = NodeLoss(victim.spec.node_name, victim.metadata.name, stopped_at,
                        committed_before, st, restored, first, None, recovery)  # fmt: skip
        c.log(f"hung rank, stop to first step: {format_budget(hang.budget())}")
        return hang

    def deleted(self) -> None:
        """Deleting the job removes every child (the garbage collector follows the
        ownerReferences) and nothing brings one back."""
        c, ns = self.cluster, self.namespace
        assert c.children(ns, self.name), "the job has no children to remove"
        self.committed_at_delete = self._last_committed()
        c.delete_job(ns, self.name)
        c.wait(lambda: not c.children(ns, self.name), "every child of the job to go", 180,
               lambda: "\n".join(c.children(ns, self.name)))  # fmt: skip

    def resumed_by_a_new_job(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """After the delete: a new job, ``resumeFrom`` the deleted one's name, at world
        size 2 restores the deleted job's last commit resharded and trains on from it (its
        own location was empty; the deleted job's uid is known only to the store), to its
        last step: `kubectl wait --for=condition=Succeeded` returns. Deleted in turn. Its
        restored event and first step."""
        c, ns, name = self.cluster, self.namespace, f"{self.name}-again"
        assert self.committed_at_delete > 0, "run deleted() first"
        # past any step the deleted job could still commit while its pods were stopping
        steps = {"CTJ_TOTAL_STEPS": str(self.committed_at_delete + 300), "CTJ_STEP_DELAY_S": "0.05"}
        job = c.example_job(name, self.backend, self.example, **{**self.training, **steps})
        job["spec"].update(self.spec, replicas=2)
        job["spec"]["checkpoint"]["resumeFrom"] = self.name
        c.apply_job(ns, job)
        st = c.wait_running(ns, name, 2, after=0)
        restored, first = c.restored(ns, name, int(st["attempt"]))
        assert restored["world_size"] == 2, restored
        assert restored["step"] >= self.committed_at_delete, (
            f"the deleted job had committed step {self.committed_at_delete}; the new job "
            f"restored {restored['step']}"
        )
        assert first["step"] == restored["step"] + 1, "training goes on from the checkpoint"
        c.kubectl("wait", f"ctj/{name}", "-n", ns, "--for=condition=Succeeded", "--timeout=180s")
        self._delete(name)
        return restored, first

    def fails_naming_a_missing_source(self) -> dict[str, Any]:
        """A job whose ``resumeFrom`` names no job with a checkpoint never starts from step 0
        in silence: its trainer stops, and the job's Failed condition (`kubectl wait
        --for=condition=Failed`) quotes the trainer's reason, naming the field. Its Failed
        condition."""
        c, ns, name = self.cluster, self.namespace, f"{self.name}-nosource"
        job = c.example_job(name, self.backend, self.example, **self.training)
        job["spec"].update(self.spec, replicas=1, minReplicas=1,
                           restartPolicy={"maxRestarts": 0})  # fmt: skip
        job["spec"]["checkpoint"]["resumeFrom"] = "no-such-job"
        c.apply_job(ns, job)
        c.kubectl("wait", f"ctj/{name}", "-n", ns, "--for=condition=Failed", "--timeout=300s")
        failed = condition(c.status(ns, name), "Failed")
        assert "spec.checkpoint.resumeFrom" in failed["message"], failed
        self._delete(name)
        return failed

    def queued_for_nodes(self) -> dict[str, Any]:
        """A job that needs more nodes than the cluster has waits, creating nothing, with a
        Queued condition that says why (`kubectl wait --for=condition=Queued`). Its Queued
        condition."""
        c, ns, name = self.cluster, self.namespace, f"{self.name}-wide"
        job = c.example_job(name, self.backend, self.example, **self.training)
        job["spec"].update(self.spec, replicas=64, minReplicas=64, maxReplicas=64)
        c.apply_job(ns, job)
        c.kubectl("wait", f"ctj/{name}", "-n", ns, "--for=condition=Queued", "--timeout=60s")
        queued = condition(c.status(ns, name), "Queued")
        assert queued["reason"] == "InsufficientNodes", queued
        assert "needs at least 64" in queued["message"], queued
        assert not c.pods(ns, name), "a queued job creates no pod"
        self._delete(name)
        return queued

    def _delete(self, name: str) -> None:
        c, ns = self.cluster, self.namespace
        c.delete_job(ns, name)
        c.wait(lambda: not c.children(ns, name), f"every child of {name} to go", 180)
