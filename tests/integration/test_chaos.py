"""Chaos: kill -9 a random participant of a job at a random moment, restart the job at a
random world size, and check that every committed checkpoint is exactly one save of one
attempt, that nothing reported committed is lost, and that verify and gc agree.

One trial:

1. Attempt 1: W1 (2-4) gloo ranks of an FSDP2-sharded model in sidecar mode, one
   ``ctj sidecar`` process per rank sharing that rank's own staging directory, saving
   every step (incremental or differential, a small full_every, keep_last 0, 64 KiB
   chunks, so saves, uploads and commits overlap). The values are a function of
   (attempt, step) (chaos_worker.py), never trained.
2. At a moment drawn for the trial (mostly a sidecar or trainer log line: a save, an
   upload, a part or a commit of a given step, or a manifest appearing in the store; else
   a random time), one random participant (a trainer rank or a sidecar) is SIGKILLed;
   after a random gap the rest of the gang is killed -9, as Kubernetes does after the
   grace.
3. Attempt 2: W2 (2-4) ranks, fresh staging directories and sidecars, load the latest
   commit (a resharding load when W2 != W1), which must be exactly attempt 1's values for
   its step, save a few more steps and close cleanly.

   In about half the trials the survivors restart in place instead (docs/operator.md,
   "In-place restart"): only the trainers die (the launcher's SIGKILL), each surviving
   sidecar lives on with its staging directory, whatever attempt 1 left staged or
   half-uploaded in it, and is told attempt 2 and its new rank by a real heartbeat ask
   (an ``Assignment``, before or after the trainers die); attempt 2's first ranks are its
   trainers on those pods, the rest get fresh sidecars. The pod of a killed sidecar is
   lost with it; a killed trainer's pod is kept.
4. Checks, in this process: every committed manifest loads (at world size 1) bitwise as
   the values its own attempt staged for its step; every save a rank 0 saw committed is
   there; ``checkpoints verify --all`` passes; ``gc --grace 0`` leaves exactly the chunks
   the manifests name and no parts; everything still verifies and loads.

Through both attempts, gc runs back to back beside the job (``ConcurrentGc``, a grace of
GC_GRACE_S): what it deletes of a save in flight, the gc fence makes the save store again.

    python -m pytest tests/integration/test_chaos.py               # 20 trials
    CTJ_CHAOS_TRIALS=200 python -m pytest tests/integration/test_chaos.py
    CTJ_CHAOS_SEED=1234 python -m pytest tests/integration/test_chaos.py -s   # one trial

A seed fixes a trial's scenario (world sizes, mode, victim, trigger, gap), not the
interleaving of the processes. CTJ_CHAOS_RECORD=path appends one JSON line per trial.
Ranks are forked from ranks.py's forkserver, which has torch imported (a fork, not an
import, per rank); sidecars are real ``python -m trainer_sidecar sidecar`` processes (no torch).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from ctj_contract import HEARTBEAT_PATH, Env, HeartbeatAsk, HeartbeatReply
from ctj_contract.launch import Assignment
from ctj_devcluster.forked import ForkedProcess

import tests.integration.ranks  # noqa: F401 - it names what the forkserver preloads
from tests.conftest import ROOT, free_port
from tests.integration import chaos_worker as cw
from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar import cli as ctj_cli
from trainer_sidecar.errors import ObjectNotFound
from trainer_sidecar.format.manifest import (
    CHUNKS,
    PARTS,
    RANKS,
    Manifest,
    SaveIdentity,
    manifest_key,
)
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.base import ObjectStore
from trainer_sidecar.store.s3 import S3Settings, open_store

pytestmark = [
    pytest.mark.integration,
    # the checks load at world size 1 without a process group, as DCP allows
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

# small chunks (and blocks, which a chunk size must be a multiple of): a rank's part of a
# save is a dozen or more chunks, so its upload spans a while and overlaps the others'
CHUNK_SIZE = 65536
# gc beside the job deletes a save's uploads older than this that nothing names yet (the
# fence has the save store them again); its parts must outlive the wait for every rank's
GC_GRACE_S = 5.0
# the job's token in the sidecars' environment (CTJ_CACHE_TOKEN): their heartbeat's
HEARTBEAT_TOKEN = "chaos-" + uuid.uuid4().hex


class ChaosFailure(AssertionError):
    """A broken invariant, by kind: mixed | lost | verify | hang | crash."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


def wait_for(
    condition: Callable[[], object], what: str, timeout: float, kind: str = "hang"
) -> None:
    """Poll ``condition`` until true; past ``timeout`` fail saying what was awaited."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not condition():
        if time.monotonic() > deadline:
            raise ChaosFailure(kind, f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


# -- processes --------------------------------------------------------------------------


class Participant:
    """A trainer rank or a sidecar: a pid, a log, kill and stop."""

    name: str
    log: Path

    @property
    def pid(self) -> int:
        raise NotImplementedError

    def returncode(self) -> int | None:
        raise NotImplementedError

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 3000) -> str:
        state = f"rc {self.returncode()}" if not self.alive() else f"alive, {self.state()}"
        return f"--- {self.name} ({state}) {self.log}\n{self.text()[-n:]}"

    def state(self) -> str:
        """The kernel's view of it (R running, S sleeping, T stopped, Z zombie)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return "state " + f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"

    def alive(self) -> bool:
        return self.returncode() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)


class Rank(Participant):
    """A trainer rank, forked by the forkserver (chaos_worker.rank_main)."""

    def __init__(self, name: str, log: Path, env: dict[str, str], target: str, args: Any) -> None:
        self.name, self.log = name, log
        self.proc = ForkedProcess(cw.rank_main, (target, args), env, log=log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> int | None:
        return self.proc.returncode


# The sidecars' launcher: one process that has imported what `ctj sidecar` imports (never
# torch) and forks a sidecar per request, so each starts in milliseconds instead of
# importing boto3 again. A child runs ``ctj sidecar`` (cli.main) with its own environment
# and log; the launcher reaps it and writes its exit status beside its log (<log>.rc).
_LAUNCHER = r"""
import faulthandler, json, os, signal, sys, traceback
import trainer_sidecar.cli as cli
import trainer_sidecar.sidecar, trainer_sidecar.store.s3
assert "torch" not in sys.modules, "ctj sidecar must not import torch"
logs, early = {}, {}

def record(pid, status):
    path = logs.pop(pid) + ".rc"
    with open(path + ".tmp", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
    os.replace(path + ".tmp", path)

def reap(signum, frame):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in logs:
            record(pid, status)
        else:
            early[pid] = status

signal.signal(signal.SIGCHLD, reap)
for line in sys.stdin:
    req = json.loads(line)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        null = os.open(os.devnull, os.O_RDWR)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(req["env"])
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, when a test hangs
        code = 1
        try:
            code = cli.main(req["argv"])
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    logs[pid] = req["log"]
    if pid in early:
        record(pid, early.pop(pid))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    print(pid, flush=True)
"""


class _SidecarLauncher:
    proc: subprocess.Popen[str] | None = None

    @classmethod
    def fork(cls, argv: list[str], env: dict[str, str], log: Path) -> int:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            atexit.register(cls.proc.kill)
        assert cls.proc.stdin is not None and cls.proc.stdout is not None
        cls.proc.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n")
        cls.proc.stdin.flush()
        reply = cls.proc.stdout.readline()  # a fork: milliseconds
        if not reply.strip():
            raise ChaosFailure("crash", f"the sidecar launcher died (rc {cls.proc.poll()})")
        return int(reply)


class SidecarProcess(Participant):
    """``ctj sidecar`` (what ``python -m trainer_sidecar sidecar`` runs) for one rank's
    staging directory, forked by the launcher above."""

    def __init__(self, name: str, log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._rc = Path(f"{log}.rc")
        self._rc.unlink(missing_ok=True)
        self._pid = _SidecarLauncher.fork(["sidecar", "--grace", "10"], env, log)

    def assign(self, assignment: Assignment) -> None:
        """What the operator's heartbeat tells a pod kept for a newer attempt (its metrics
        port, the job's token): the sidecar must answer that it serves it."""
        port = int(re.findall(r"on port (\d+)", self.text())[-1])
        ask = HeartbeatAsk(attempt=assignment.attempt, assignment=assignment)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{HEARTBEAT_PATH}",
            data=ask.encode(),
            headers={"Authorization": f"Bearer {HEARTBEAT_TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            reply = HeartbeatReply.decode(r.read())
        if (reply.attempt, reply.node_rank) != (assignment.attempt, assignment.node_rank):
            raise ChaosFailure("crash", f"{self.name} did not take {assignment}: {reply}")

    @property
    def pid(self) -> int:
        return self._pid

    def returncode(self) -> int | None:
        try:
            return int(self._rc.read_text())
        except FileNotFoundError:
            return None


@dataclasses.dataclass(frozen=True)
class JobSpec:
    uri: str
    attempt: str
    world: int
    root: Path  # logs and staging of this job
    mode: str = "incremental"
    full_every: int = 3
    slots: int = 1
    sidecar: bool = True
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # extra CTJ_* settings
    heartbeat: bool = False  # the sidecars answer the operator's heartbeat (in place)


class Job:
    """W ranks of one attempt and, in sidecar mode, a sidecar per rank (own staging)."""

    def __init__(self, spec: JobSpec, args: dict[str, Any], *, trainers: bool = True) -> None:
        self.spec = spec
        self.args = args
        spec.root.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.key = uuid.uuid4().hex[:8]  # its staging directories' name
        self.kept: dict[int, Path] = {}  # rank -> the staging of a pod kept from before
        self.trainers: list[Rank] = []
        self.sidecars: list[SidecarProcess] = []
        if spec.sidecar:
            for r in range(spec.world):
                self.start_sidecar(r)
        if trainers:
            self.start_trainers()

    def wait(self, condition: Callable[[], object], what: str, timeout: float) -> None:
        """wait_for, and on a timeout every live process's stacks and log in the failure."""
        try:
            wait_for(condition, what, timeout)
        except ChaosFailure as exc:
            raise ChaosFailure("hang", f"{exc}\n{self.stacks()}") from None

    def stacks(self) -> str:
        """SIGUSR1 makes every live participant print its threads' stacks (faulthandler)."""
        alive = [p for p in self.participants if p.alive() and "state T" not in p.state()]
        before = {p.name: p.text().count("most recent call first") for p in alive}
        for p in alive:
            p.signal(signal.SIGUSR1)
        with contextlib.suppress(ChaosFailure):
            wait_for(
                lambda: all(
                    p.text().count("most recent call first") > before[p.name] for p in alive
                ),
                "the stack dumps",
                10,
            )
        return "\n".join(p.tail(8000) for p in self.participants)

    def wait_sidecars_ready(self, timeout: float = 60) -> None:
        """Each sidecar has read the store once (publish_latest) and is polling its slots."""
        self.wait(
            lambda: all("persisting" in s.text() or not s.alive() for s in self.sidecars),
            f"attempt {self.spec.attempt}'s sidecars to start",
            timeout,
        )
        dead = [s for s in self.sidecars if not s.alive()]
        if dead:
            raise ChaosFailure("crash", "a sidecar exited at start:\n" + self.tails())

    @property
    def base(self) -> Path:
        # memory-backed like an emptyDir: under the session's private staging root
        return Path(os.environ["CTJ_STAGING_DIR"]) / f"job-{self.key}"

    def staging(self, rank: int) -> Path:
        if rank in self.kept:
            return self.kept[rank]
        return self.base / f"attempt-{self.spec.attempt}" / f"rank-{rank}"

    def keep(self, rank: int, sidecar: SidecarProcess, staging: Path) -> None:
        """``rank`` runs on a pod kept from the attempt before: its sidecar and staging
        directory serve this attempt's trainer (the fresh sidecar started for it goes)."""
        fresh = self.sidecars[rank]
        fresh.kill()
        self.wait(lambda: not fresh.alive(), f"{fresh.name} to die", 30)
        self.sidecars[rank], self.kept[rank] = sidecar, staging

    def idle(self, rank: int) -> bool:
        """Nothing staged for rank's persister: every slot released."""
        return not any(self.staging(rank).rglob("ready.json"))

    def env(self, rank: int) -> dict[str, str]:
        s = self.spec
        env = dict(
            os.environ,
            CTJ_CHECKPOINT_URI=s.uri,
            CTJ_ATTEMPT=s.attempt,
            CTJ_SIDECAR="1" if s.sidecar else "0",
            CTJ_CHECKPOINT_MODE=s.mode,
            CTJ_CHECKPOINT_FULL_EVERY=str(s.full_every),
            CTJ_CHECKPOINT_KEEP_LAST="0",
            CTJ_CHECKPOINT_CHUNK_SIZE=str(CHUNK_SIZE),
            CTJ_CHECKPOINT_BLOCK_SIZE=str(CHUNK_SIZE),
            CTJ_CHECKPOINT_PARALLELISM="2",
            CTJ_STAGING_SLOTS=str(s.slots),
            CTJ_STAGING_DIR=str(self.staging(rank)),
            OMP_NUM_THREADS="1",
        )
        return env | s.env

    def start_sidecar(self, rank: int, log_suffix: str = "") -> SidecarProcess:
        log = self.spec.root / f"a{self.spec.attempt}-sidecar-{rank}{log_suffix}.log"
        env = self.env(rank)
        if self.spec.heartbeat:  # as the operator's pods: a token, a port, the pod's place
            env |= {Env.CACHE_TOKEN: HEARTBEAT_TOKEN, Env.NODE_RANK: str(rank),
                    "CTJ_METRICS_PORT": "0", "CTJ_METRICS_HOST": "127.0.0.1"}  # fmt: skip
        sidecar = SidecarProcess(f"attempt {self.spec.attempt} sidecar {rank}", log, env)
        if rank < len(self.sidecars):
            self.sidecars[rank] = sidecar
        else:
            self.sidecars.append(sidecar)
        return sidecar

    def start_trainers(self, port: int | None = None) -> None:
        self.started = time.monotonic()
        master_port = str(port or free_port())
        for r in range(self.spec.world):
            env = dict(
                self.env(r),
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(self.spec.world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=master_port,
            )
            log = self.spec.root / f"a{self.spec.attempt}-trainer-{r}.log"
            self.trainers.append(
                Rank(f"attempt {self.spec.attempt} trainer {r}", log, env, "run_trainer", self.args)
            )

    @property
    def participants(self) -> list[Participant]:
        return [*self.trainers, *self.sidecars]

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.participants)

    def kill_all(self, timeout: float = 30) -> None:
        for p in self.participants:
            p.signal(signal.SIGCONT)  # a stopped process dies of SIGKILL too, but say so
            p.kill()
        self.wait(lambda: not any(p.alive() for p in self.participants), "the gang to die", timeout)

    def wait_trainers(self, timeout: float) -> None:
        """Every trainer exits 0 within ``timeout``; else fail with their logs."""

        def finished() -> bool:
            if any(t.returncode() not in (None, 0) for t in self.trainers):
                return True
            return all(t.returncode() == 0 for t in self.trainers)

        self.wait(finished, f"attempt {self.spec.attempt}'s trainers to finish", timeout)
        if any(t.returncode() != 0 for t in self.trainers):
            text = "\n".join(t.text() for t in self.trainers)
            kind = next((k.lower() for k in ("MIXED", "LOST") if f"{k}:" in text), "crash")
            raise ChaosFailure(kind, f"attempt {self.spec.attempt} failed:\n{self.tails()}")

    def stop_sidecars(self, timeout: float = 60) -> None:
        """SIGTERM: each sidecar finishes what is staged and exits 0 (nothing left)."""
        for s in self.sidecars:
            s.signal(signal.SIGTERM)
        self.wait(
            lambda: not any(s.alive() for s in self.sidecars),
            f"attempt {self.spec.attempt}'s sidecars to exit on SIGTERM",
            timeout,
        )
        bad = [s for s in self.sidecars if s.returncode() != 0]
        if bad:
            raise ChaosFailure("crash", "sidecars exited non-zero:\n" + self.tails())

    def cleanup(self) -> None:
        with contextlib.suppress(ChaosFailure):
            self.kill_all()
        shutil.rmtree(self.base, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class SaveReport:
    outcome: str  # committed | raised
    attempt: str
    step: int
    nonce: str
    error: str = ""  # "<Type>: <message>" when raised


_RESULT = re.compile(r"^RESULT (committed|raised) (\S+) (\d+) ([0-9a-f]{16})(?: (.*))?$", re.M)


def reports(text: str) -> list[SaveReport]:
    """What a rank 0 printed about its saves (complete lines only: it may die mid-line)."""
    complete = text[: text.rfind("\n") + 1]
    return [SaveReport(m[1], m[2], int(m[3]), m[4], m[5] or "") for m in _RESULT.finditer(complete)]


# -- checks of a location ----------------------------------------------------------------


class Location:
    """The store at a URI and a loader for it, in this process (world size 1)."""

    def __init__(self, uri: str, staging: Path) -> None:
        self.uri = uri
        self.store: ObjectStore = open_store(uri, S3Settings.from_env())
        self.loader = Checkpointer(
            CheckpointConfig(uri=uri, staging_dir=str(staging), parallelism=2), store=self.store
        )

    def manifests(self) -> dict[int, Manifest]:
        return {s: repo.read_manifest(self.store, s) for s in repo.committed_steps(self.store)}

    def has_manifest(self, step: int) -> bool:
        try:
            self.store.get(manifest_key(step), byte_range=(0, 1))
            return True
        except ObjectNotFound:
            return False

    def keys(self, prefix: str) -> set[str]:
        return {o.key for o in self.store.list(prefix)}

    def load_exact(self, manifest: Manifest, *, others: list[str]) -> None:
        """Step ``manifest.step`` loads bitwise as its own attempt's values for that step."""
        step = manifest.step
        assert manifest.save is not None, f"step {step}: a manifest without a save identity"
        attempt = manifest.save.attempt
        model, opt = cw.build(sharded=False)
        extra: dict[str, Any] = {"attempt": "", "step": -1}
        try:
            loaded = self.loader.load(model=model, optimizer=opt, extra=extra, step=step)
        except Exception as exc:  # noqa: BLE001 - reported with the step
            raise ChaosFailure("lost", f"committed step {step} does not load: {exc!r}") from exc
        if loaded is None or loaded.step != step or loaded.skipped:
            raise ChaosFailure("lost", f"committed step {step} did not load: got {loaded}")
        want = cw.expected_state(attempt, step)
        bad = cw.mismatches(model, opt, attempt, step)
        if extra != want["extra"] or bad:
            owners = cw.which_values(model, opt, [(a, step) for a in [attempt, *others]])
            raise ChaosFailure(
                "mixed",
                f"step {step} (committed by {manifest.save}) is not exactly attempt "
                f"{attempt}'s values: extra {extra}, differing {bad[:8]}; whose: {owners}",
            )

    def check(self, committed: list[SaveReport], attempts: list[str]) -> dict[str, Any]:
        """Every invariant of the location; returns figures for the record. ``committed``:
        the saves a rank 0 was told were committed (each must be what the store holds)."""
        assert all(r.outcome == "committed" for r in committed), committed
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small tensors: OpenMP's spin-up costs more than it saves
        try:
            return self._check(committed, attempts)
        finally:
            torch.set_num_threads(threads)

    def _check(self, committed: list[SaveReport], attempts: list[str]) -> dict[str, Any]:
        manifests = self.manifests()
        for m in manifests.values():
            self.load_exact(m, others=[a for a in attempts if m.save and a != m.save.attempt])
        for r in committed:
            found = manifests.get(r.step)
            if found is None or found.save != SaveIdentity(r.attempt, r.nonce):
                who = found.save if found else "nothing"
                raise ChaosFailure(
                    "lost",
                    f"attempt {r.attempt}'s save of step {r.step} ({r.nonce}) was reported "
                    f"committed, but the store holds {who} there",
                )
        self.verify("before gc")
        gc = self.cli("gc", "--grace", "0")
        if gc != 0:
            raise ChaosFailure("verify", f"gc --grace 0 exited {gc}")
        after = self.manifests()
        if set(after) != set(manifests):
            raise ChaosFailure(
                "verify", f"gc changed the commits: {sorted(manifests)} -> {sorted(after)}"
            )
        named = set().union(*(m.chunk_keys() for m in after.values())) if after else set()
        named_ranks = set().union(*(m.rank_keys() for m in after.values())) if after else set()
        chunks, parts, ranks = self.keys(CHUNKS), self.keys(PARTS), self.keys(RANKS)
        if chunks != named or parts or ranks != named_ranks:
            raise ChaosFailure(
                "verify",
                f"after gc --grace 0: {len(named - chunks)} named chunks missing, "
                f"{len(chunks - named)} unnamed chunks left, parts left: {sorted(parts)[:5]}, "
                f"{len(named_ranks - ranks)} named rank manifests missing, "
                f"{len(ranks - named_ranks)} unnamed ones left",
            )
        self.verify("after gc")
        for m in after.values():
            self.load_exact(m, others=[])
        return {"commits": sorted(manifests), "chunks": len(chunks)}

    def cli(self, *argv: str) -> int:
        """``ctj checkpoints <argv[0]> URI <argv[1:]>`` (what ``python -m trainer_sidecar``
        runs), in this process and over this store's client: no torch import, no new
        boto3 client per command."""
        with mock.patch.object(ctj_cli, "_store", lambda args: self.store):
            return ctj_cli.main(["checkpoints", argv[0], self.uri, *argv[1:]])

    def verify(self, when: str) -> None:
        rc = self.cli("verify", "--all")
        if rc != 0:
            raise ChaosFailure("verify", f"checkpoints verify --all exited {rc} ({when})")


class ConcurrentGc:
    """gc beside both attempts, back to back, on its own client (as an operator's
    ``ctj checkpoints gc`` would run, or a rank 0 after a commit that retired one), with a
    grace of GC_GRACE_S: a save's uploads older than that are fair game, and only the gc
    fence (store/gc_fence.py) keeps what a save names. It must never cost a commit."""

    def __init__(self, uri: str) -> None:
        self.store = open_store(uri, S3Settings.from_env())
        self.stop = threading.Event()
        self.runs = self.deleted = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="concurrent-gc", daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                report = repo.collect_garbage(self.store, grace_s=GC_GRACE_S)
            except BaseException as exc:  # noqa: BLE001 - the trial reports it
                self.error = exc
                return
            self.runs += 1
            self.deleted += report.deleted_chunks + report.deleted_rank_manifests
            self.stop.wait(1.0)  # the pace between runs (moto serves the job too), not a wait

    def __enter__(self) -> ConcurrentGc:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(120)

    def figures(self) -> dict[str, int]:
        if self.error is not None:
            raise ChaosFailure("gc", f"gc beside the job failed: {self.error!r}")
        if self.thread.is_alive():
            raise ChaosFailure("hang", "gc beside the job did not stop within 120s")
        return {"runs": self.runs, "deleted": self.deleted}


# -- one trial -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    seed: int
    w1: int
    w2: int
    mode: str
    full_every: int
    slots: int
    steps1: int
    steps2: int
    victim: tuple[str, int]  # ("trainer" | "sidecar", rank)
    trigger: str  # saving | staged | uploading | uploaded | committed | manifest | time
    trigger_rank: int
    trigger_step: int
    after_s: float  # for "time": seconds after rank 0 starts saving step 1
    jitter_s: float  # after the trigger, before the kill
    gap_s: float  # between the kill and the teardown of the rest
    in_place: bool = False  # the survivors' pods are kept: only their trainers die
    assign_first: bool = False  # in place: the assignment reaches the sidecars first

    @classmethod
    def draw(cls, seed: int) -> Scenario:
        rng = random.Random(seed)
        w1, w2 = rng.randint(2, 4), rng.randint(2, 4)
        steps1 = rng.randint(3, 6)
        trigger = rng.choices(
            ["saving", "staged", "uploading", "uploaded", "committed", "manifest", "time"],
            weights=[1, 1, 2, 3, 2, 1, 2],
        )[0]
        trigger_rank = 0 if trigger in ("committed", "manifest") else rng.randrange(w1)
        kind = rng.choice(["trainer", "sidecar"])
        return cls(
            seed=seed,
            w1=w1,
            w2=w2,
            mode=rng.choice(["incremental", "differential"]),
            full_every=rng.randint(2, 4),
            slots=rng.choice([1, 2]),
            steps1=steps1,
            steps2=rng.randint(2, 3),
            victim=(kind, rng.randrange(w1)),
            trigger=trigger,
            trigger_rank=trigger_rank,
            trigger_step=rng.randint(1, steps1),
            after_s=rng.uniform(0, 0.5 * steps1),
            jitter_s=rng.choice([0.0, rng.uniform(0, 0.05)]),
            gap_s=rng.choice([0.0, rng.uniform(0, 0.5)]),
            in_place=rng.random() < 0.5,
            assign_first=rng.random() < 0.5,
        )

    def describe(self) -> str:
        victim = f"{self.victim[0]} {self.victim[1]}"
        if self.trigger == "time":
            when = f"{self.after_s:.2f}s into the saves"
        else:
            when = f"{self.trigger} step {self.trigger_step} (rank {self.trigger_rank})"
        rest = "the rest"
        if self.in_place:
            order = "before" if self.assign_first else "after"
            rest = f"the other trainers (in place: the sidecars told attempt 2 {order} it)"
        return (
            f"seed {self.seed}: W {self.w1}->{self.w2}, {self.mode} full_every {self.full_every}, "
            f"{self.slots} slot(s), {self.steps1}+{self.steps2} steps; kill {victim} at {when} "
            f"+{self.jitter_s * 1000:.0f}ms, {rest} {self.gap_s * 1000:.0f}ms later"
        )


def trigger_condition(sc: Scenario, job: Job, where: Location) -> tuple[Callable[[], bool], str]:
    k, r = sc.trigger_step, sc.trigger_rank
    if sc.trigger == "time":
        started: list[float] = []

        def timed() -> bool:
            if not started and "SAVING 1\n" in job.trainers[0].text():
                started.append(time.monotonic())
            return bool(started) and time.monotonic() - started[0] >= sc.after_s

        return timed, f"{sc.after_s:.2f}s after rank 0 began saving step 1"
    if sc.trigger == "manifest":
        last = [0.0]

        def committed() -> bool:
            if time.monotonic() - last[0] < 0.01:
                return False
            last[0] = time.monotonic()
            return where.has_manifest(k)

        return committed, f"the manifest of step {k} in the store"
    who, needle = {
        "saving": (job.trainers[r], f"SAVING {k}\n"),
        "staged": (job.trainers[r], f"STAGED {k} "),
        "uploading": (job.sidecars[r], f"uploading step {k} (rank {r},"),
        "uploaded": (job.sidecars[r], f"rank {r} uploaded step {k}:"),
        "committed": (job.sidecars[0], f"committed step {k} ("),
    }[sc.trigger]
    return (lambda: needle in who.text()), f"{needle.strip()!r} in {who.name}'s log"


def run_attempt1(sc: Scenario, job: Job, where: Location) -> dict[str, Any]:
    """Run until the trigger, kill the victim, then (after the gap) everything, or in
    place only what ``restart_in_place`` kills."""
    fire, what = trigger_condition(sc, job, where)
    deadline = time.monotonic() + 120
    note = "fired"
    delay = 0.001
    while not fire():
        crashed = [p for p in job.participants if p.returncode() not in (None, 0)]
        if crashed:
            raise ChaosFailure("crash", f"died before any kill:\n{job.tails()}")
        if all(t.returncode() == 0 for t in job.trainers):
            note = "after attempt 1 finished"  # the trigger can no longer come: kill now
            break
        if time.monotonic() > deadline:
            raise ChaosFailure("hang", f"timed out waiting for {what}\n{job.stacks()}")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)
    fired_at = time.monotonic()
    if sc.jitter_s:
        time.sleep(sc.jitter_s)  # the drawn moment itself, not a wait for anything
    kind, rank = sc.victim
    victim = (job.trainers if kind == "trainer" else job.sidecars)[rank]
    victim.kill()
    if sc.gap_s:
        time.sleep(sc.gap_s)  # the survivors run on, as in the grace before a teardown
    if not sc.in_place:
        job.kill_all()
    return {"trigger": note, "killed_after_s": round(fired_at - job.started, 3)}


def restart_in_place(sc: Scenario, first: Job, second: Job, port: int) -> list[int]:
    """What the operator and the ctj launcher do to a failed attempt whose pods are kept
    (docs/operator.md, "In-place restart"): the pods whose sidecar lives are attempt 2's
    first ranks, in their old order (a killed sidecar's pod is lost with it; those past
    W2 are deleted); each sidecar is told its place by the heartbeat, and every attempt-1
    trainer is SIGKILLed, the launcher's way, in the drawn order. Returns the old ranks
    kept."""
    kind, rank = sc.victim
    if kind == "sidecar":  # its launcher reaps it a moment after the SIGKILL
        dead = first.sidecars[rank]
        first.wait(lambda: not dead.alive(), f"{dead.name} to die", 30)
    survivors = [r for r, s in enumerate(first.sidecars) if s.alive()]
    kept = survivors[: sc.w2]
    for r in survivors[sc.w2 :]:
        first.sidecars[r].kill()

    def assign() -> None:
        for rank, old in enumerate(kept):
            first.sidecars[old].assign(Assignment(attempt=2, node_rank=rank, world_size=sc.w2,
                                                  nproc_per_node=1, master_addr="127.0.0.1",
                                                  master_port=port))  # fmt: skip

    if sc.assign_first:
        assign()
    for t in first.trainers:
        t.signal(signal.SIGCONT)
        t.kill()
    first.wait(lambda: not any(t.alive() for t in first.trainers), "the trainers to die", 30)
    if not sc.assign_first:
        assign()
    for rank, old in enumerate(kept):
        second.keep(rank, first.sidecars[old], first.staging(old))
    return kept


class Record:
    """Per-trial figures: a JSON line each (CTJ_CHAOS_RECORD) and a summary at the end."""

    def __init__(self) -> None:
        self.trials: list[dict[str, Any]] = []
        self.path = os.environ.get("CTJ_CHAOS_RECORD")
        self.started = time.monotonic()

    def add(self, entry: dict[str, Any]) -> None:
        self.trials.append(entry)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for t in self.trials:
            if t.get("failure"):
                kinds[t["failure"]] = kinds.get(t["failure"], 0) + 1
        secs = [t["seconds"] for t in self.trials]
        figures = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"
        mean = sum(secs) / len(secs) if secs else 0.0
        return (
            f"chaos: {len(self.trials)} trials, {sum(kinds.values())} failed ({figures}); "
            f"{time.monotonic() - self.started:.0f}s in all, {mean:.1f}s a trial"
        )


@pytest.fixture(scope="module")
def chaos_record(request: pytest.FixtureRequest) -> Iterator[Record]:
    record = Record()
    yield record
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    line = record.summary()
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # shown even without -s
            reporter.write_line("")
            reporter.write_line(line)
    if record.path:
        with open(record.path, "a") as f:
            f.write(json.dumps({"summary": line}) + "\n")


def _seeds() -> list[int]:
    if os.environ.get("CTJ_CHAOS_SEED"):
        return [int(os.environ["CTJ_CHAOS_SEED"])]
    trials = int(os.environ.get("CTJ_CHAOS_TRIALS", "20"))
    base = os.environ.get("CTJ_CHAOS_BASE_SEED")
    first = int(base) if base else random.SystemRandom().randrange(1, 10**9)
    return [first + i for i in range(trials)]


@pytest.mark.parametrize("seed", _seeds(), ids=lambda s: f"seed{s}")
def test_chaos_trial(seed: int, s3_uri: str, tmp_path: Path, chaos_record: Record) -> None:
    sc = Scenario.draw(seed)
    print(sc.describe())
    started = time.monotonic()
    entry: dict[str, Any] = {"seed": seed, "scenario": sc.describe(), "failure": None}
    jobs: list[Job] = []
    try:
        entry.update(run_trial(sc, s3_uri, tmp_path, jobs))
    except ChaosFailure as exc:
        entry["failure"] = exc.kind
        raise AssertionError(
            f"{exc}\n(rerun this trial: CTJ_CHAOS_SEED={seed} python -m pytest "
            f"tests/integration/test_chaos.py -s; logs in {tmp_path})"
        ) from None
    except BaseException:
        entry["failure"] = "error"
        raise
    finally:
        for job in jobs:
            job.cleanup()
        entry["seconds"] = round(time.monotonic() - started, 2)
        chaos_record.add(entry)
        print(f"trial done in {entry['seconds']}s: {entry}")


def run_trial(sc: Scenario, uri: str, tmp: Path, jobs: list[Job]) -> dict[str, Any]:
    where = Location(uri, tmp / "loader-staging")
    spec = JobSpec(
        uri=uri,
        attempt="1",
        world=sc.w1,
        root=tmp,
        mode=sc.mode,
        full_every=sc.full_every,
        slots=sc.slots,
    )
    # attempt 2's sidecars (own, fresh staging) start now too, idle until it stages: a
    # sidecar takes seconds to start on a busy machine. The store is empty while they
    # start, so they publish no latest commit (a stale one would cost bytes, not bits).
    spec = dataclasses.replace(spec, heartbeat=sc.in_place)
    first = Job(spec, {"steps": sc.steps1}, trainers=False)
    second = Job(
        dataclasses.replace(spec, attempt="2", world=sc.w2),
        {"steps": sc.steps2, "load": True, "expect_attempt": "1"},
        trainers=False,
    )
    jobs += [first, second]
    first.wait_sidecars_ready()
    second.wait_sidecars_ready()
    phases = {"sidecars": time.monotonic() - first.started}
    with ConcurrentGc(uri) as gc:
        first.start_trainers()
        figures = run_attempt1(sc, first, where)
        phases["attempt_1"] = time.monotonic() - first.started
        seen1 = reports(first.trainers[0].text())
        port = free_port()
        if sc.in_place:
            figures["kept"] = restart_in_place(sc, first, second, port)
            phases["in_place"] = time.monotonic() - first.started

        second.start_trainers(port)
        second.wait_trainers(timeout=180)
        second.stop_sidecars()
        phases["attempt_2"] = time.monotonic() - second.started
    figures["gc"] = gc.figures()
    logs = {p.log: p for job in (first, second) for p in job.participants}  # a kept one once
    figures["gc"]["stored_again"] = sum(  # the fence at work: a save storing a chunk again
        p.text().count("storing them once more") for p in logs.values()
    )
    text2 = second.trainers[0].text()
    loaded = re.search(r"^LOADED (\S+)", text2, re.M)
    seen2 = reports(text2)
    committed1 = [r for r in seen1 if r.outcome == "committed"]
    top = max((r.step for r in committed1), default=0)
    loaded_step = 0 if loaded is None or loaded[1] == "none" else int(loaded[1])
    if loaded_step < top:
        raise ChaosFailure(
            "lost", f"attempt 2 loaded step {loaded_step}, attempt 1 saw step {top} committed"
        )
    manifests = where.manifests()
    late = []
    for r in seen2:
        if r.outcome == "committed":
            continue
        # the one excuse: a PUT attempt 1 had sent before it was killed landed after the load
        m = manifests.get(r.step)
        if not (r.error.startswith("CommitConflict") and m and m.save and m.save.attempt == "1"):
            raise ChaosFailure("lost", f"attempt 2's save of step {r.step} failed: {r.error}")
        late.append(r.step)
    want2 = sc.steps2
    if len(seen2) != want2:
        raise ChaosFailure("crash", f"attempt 2's rank 0 reported {len(seen2)} of {want2} saves")
    committed2 = [r for r in seen2 if r.outcome == "committed"]  # not the late ones excused
    checked = time.monotonic()
    figures.update(where.check([*committed1, *committed2], ["1", "2"]))
    phases["checks"] = time.monotonic() - checked
    figures["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    figures.update(
        {
            "committed_1": [r.step for r in committed1],
            "raised_1": [r.step for r in seen1 if r.outcome == "raised"],
            "loaded": loaded_step,
            "committed_2": [r.step for r in committed2],
            "late_commits_of_1": late,
        }
    )
    return figures


def test_chaos_values_are_a_function_of_attempt_and_step() -> None:
    """The premise of every check: equal (attempt, step) gives equal bits, any other
    attempt differs in every tensor, and the next step differs in most."""
    a = cw.expected_state("1", 4)
    b = cw.expected_state("1", 4)
    c = cw.expected_state("2", 4)
    d = cw.expected_state("1", 5)

    def flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
        optim = {f"{n}:{k}": v for n, kv in state["optim"].items() for k, v in kv.items()}
        return optim | {f"{n}:param": v for n, v in state["model"].items()}

    fa, fb, fc, fd = flat(a), flat(b), flat(c), flat(d)
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    assert not any(torch.equal(fa[k], fc[k]) for k in fa)
    changed = {k for k in fa if not torch.equal(fa[k], fd[k])}
    assert {"fc2.weight:param", "fc2.weight:exp_avg", "fc1.weight:step"} <= changed, changed
    assert "fc2.weight:exp_avg_sq" not in changed  # fixed within an attempt: deduplicated
