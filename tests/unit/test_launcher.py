"""The trainer container's launcher, run for real: it starts the worker with the pod's
environment, restarts it in place on a newer assignment (killing one that ignores SIGTERM
after the grace), reports a failed worker and waits, ends with a worker that exits 0,
forwards the kubelet's SIGTERM, and shrugs off hostile assignment files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ctj_contract.env import Env
from ctj_contract.launch import ASSIGNMENT_FILE, EXIT_FILE, Assignment, WorkerExit, write_atomic

ROOT = Path(__file__).resolve().parents[2]
POD = Assignment(
    attempt=2,
    node_rank=1,
    world_size=2,
    nproc_per_node=1,
    master_addr="job-2-0.job",
    master_port=29502,
)
NEWER = Assignment(
    attempt=3,
    node_rank=0,
    world_size=3,
    nproc_per_node=2,
    master_addr="job-3-0.job",
    master_port=29503,
)
KEYS = ("RANK", "WORLD_SIZE", "CTJ_ATTEMPT", "MASTER_ADDR", "MASTER_PORT", "PET_NNODES")

# The worker: sets up its signals, reports its pid, parent and environment (a file named by
# its pid, written whole), then acts on its mode: "exit=N" exits N in the pod's attempt
# (POD's) and idles in any other; "ignore-term" and "trap-term=N" idle with SIGTERM ignored or
# exiting N; "idle" idles.
WORKER = (
    f"keys, first = {KEYS!r}, {str(POD.attempt)!r}\n"
    + r"""
import json, os, signal, sys, time
from pathlib import Path
reports, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode.startswith("trap-term="):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(mode[10:])))
env = {k: os.environ.get(k) for k in keys}
record = {"t": time.monotonic(), "pid": os.getpid(), "ppid": os.getppid(), "env": env}
tmp = reports / f".{os.getpid()}"
tmp.write_text(json.dumps(record))
os.replace(tmp, reports / f"{os.getpid()}.json")
if mode.startswith("exit=") and os.environ["CTJ_ATTEMPT"] == first:
    print("training, then a fault", flush=True)
    print(f"spec.checkpoint.resumeFrom: nothing to resume; exiting {mode[5:]}", file=sys.stderr)
    sys.exit(int(mode[5:]))
while True:
    signal.pause()
"""
)


def wait_for(check: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def child_env(staging: Path | None) -> dict[str, str]:
    env = {**os.environ, **POD.environment()}
    paths = [str(ROOT), str(ROOT / "contract"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.pop(Env.STAGING_DIR, None)
    if staging is not None:
        env[Env.STAGING_DIR] = str(staging)
    return env


class Pod:
    """A launcher in ``tmp_path`` (its staging volume), its workers' reports and its log."""

    def __init__(self, tmp_path: Path) -> None:
        self.staging = tmp_path
        self.reports_dir = tmp_path / "reports"
        self.reports_dir.mkdir()
        self.log = tmp_path / "launcher.log"
        self.assignment = tmp_path / "launch" / ASSIGNMENT_FILE
        self.exit = tmp_path / "launch" / EXIT_FILE
        self.proc: subprocess.Popen[bytes] | None = None

    def start(
        self,
        mode: str,
        *opts: str,
        staging: bool = True,
        env: dict[str, str] | None = None,
        script: bool = False,
    ) -> subprocess.Popen[bytes]:
        """``script``: the worker as ``python worker.py`` (what a standby can run), not
        ``python -c``."""
        cmd = [sys.executable, "-m", "trainer_sidecar.launcher", "--poll-seconds", "0.05"]
        program = ["-c", WORKER]
        if script:
            path = self.staging / "worker.py"
            path.write_text(WORKER)
            program = [str(path)]
        cmd += [*opts, "--", sys.executable, *program, str(self.reports_dir), mode]
        environment = {**child_env(self.staging if staging else None), **(env or {})}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=environment, stdout=log, stderr=log)
        return self.proc

    def reports(self) -> list[dict[str, Any]]:
        """Every worker's report, in the order they started."""
        found = [json.loads(p.read_text()) for p in self.reports_dir.glob("*.json")]
        return sorted(found, key=lambda r: r["t"])

    def worker(self, n: int) -> dict[str, Any]:
        """The n-th worker's report (from 1), once it started; no more than n started."""
        wait_for(lambda: len(self.reports()) >= n, f"worker {n} to start")
        found = self.reports()
        assert len(found) == n, found
        return found[-1]

    def ignored(self) -> int:
        return self.log.read_text().count("ignoring assignment")

    def close(self) -> None:
        """Kill the launcher, then every worker still running and every standby (by its
        group, where its command line or its environment names this pod's directory: a
        pid is checked before it is signalled). A worker a standby became has the
        standby's command line, and both run in sessions of their own, so killing the
        launcher alone would leave them running."""
        pids = {report["pid"] for report in self.reports()}
        if self.proc is not None and self.proc.poll() is None:
            pids |= set(children(self.proc.pid))  # its workers and standbys, before it goes
            self.proc.kill()
            self.proc.wait()
        ours = str(self.staging).encode()
        for pid in pids:
            with contextlib.suppress(OSError):
                proc = Path(f"/proc/{pid}")
                if ours in (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes():
                    os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    found = Pod(tmp_path)
    yield found
    found.close()


def test_the_worker_gets_the_pods_environment_at_first_start(pod: Pod) -> None:
    launcher = pod.start("idle")
    report = pod.worker(1)
    assert report["ppid"] == launcher.pid
    expected = POD.environment()
    assert report["env"] == {k: expected[k] for k in KEYS}
    assert launcher.poll() is None


def test_a_newer_assignment_restarts_the_worker_in_place(pod: Pod) -> None:
    launcher = pod.start("idle")
    first = pod.worker(1)
    write_atomic(pod.assignment, NEWER.encode())
    second = pod.worker(2)
    assert second["pid"] != first["pid"] and not alive(first["pid"])
    assert second["ppid"] == launcher.pid and launcher.poll() is None
    expected = NEWER.environment()
    assert second["env"] == {k: expected[k] for k in KEYS}
    assert second["env"]["RANK"] == "0" and second["env"]["WORLD_SIZE"] == "6"


def test_a_warm_spare_runs_no_worker_until_an_assignment_makes_it_a_rank(pod: Pod) -> None:
    launcher = pod.start("idle", env={Env.STANDBY: "1", Env.ATTEMPT: "0"})
    wait_for(lambda: "warm spare" in pod.log.read_text(), "the launcher to stand by")
    assert pod.reports() == [] and launcher.poll() is None
    write_atomic(pod.assignment, NEWER.encode())
    first = pod.worker(1)
    expected = NEWER.environment()
    assert first["env"] == {k: expected[k] for k in KEYS}
    assert first["ppid"] == launcher.pid


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_a_spare_with_preload_starts_its_worker_from_a_standby(pod: Pod) -> None:
    spare = {Env.STANDBY: "1", Env.ATTEMPT: "0", Env.PRELOAD: "json,email.message"}
    launcher = pod.start("idle", env=spare, script=True)
    wait_for(lambda: len(children(launcher.pid)) == 1, "the standby")
    (standby,) = children(launcher.pid)
    assert pod.reports() == []
    write_atomic(pod.assignment, NEWER.encode())
    first = pod.worker(1)
    assert first["pid"] == standby, "the standby became the worker"
    expected = NEWER.environment()
    assert first["env"] == {k: expected[k] for k in KEYS}
    assert "started (imports done ahead)" in pod.log.read_text()


def test_an_in_place_restart_takes_the_standby_and_makes_the_next(pod: Pod) -> None:
    env = {Env.PRELOAD: "json"}
    launcher = pod.start("idle", "--standby-delay-seconds", "0", env=env, script=True)
    first = pod.worker(1)
    wait_for(lambda: len(children(launcher.pid)) == 2, "a standby beside the worker")
    (standby,) = set(children(launcher.pid)) - {first["pid"]}
    write_atomic(pod.assignment, NEWER.encode())
    second = pod.worker(2)
    assert second["pid"] == standby and not alive(first["pid"])
    assert second["env"]["CTJ_ATTEMPT"] == str(NEWER.attempt)
    wait_for(lambda: len(children(launcher.pid)) == 2, "the next standby")


def test_preload_with_a_command_a_standby_cannot_run_starts_cold(pod: Pod) -> None:
    launcher = pod.start("idle", "--standby-delay-seconds", "0", env={Env.PRELOAD: "json"})
    pod.worker(1)
    wait_for(lambda: "every worker starts cold" in pod.log.read_text(), "the warning")
    assert len(children(launcher.pid)) == 1, "no standby for `python -c`"


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(pod: Pod) -> None:
    launcher = pod.start("ignore-term", "--grace-seconds", "0.3")
    first = pod.worker(1)
    began = time.monotonic()
    write_atomic(pod.assignment, NEWER.encode())
    pod.worker(2)
    assert time.monotonic() - began >= 0.3, "restarted before the grace ran out"
    assert not alive(first["pid"]) and launcher.poll() is None


def test_a_failed_worker_is_reported_and_the_pod_waits_for_the_next_assignment(
    pod: Pod,
) -> None:
    launcher = pod.start("exit=3")
    pod.worker(1)
    wait_for(pod.exit.exists, "the exit file")
    why = "spec.checkpoint.resumeFrom: nothing to resume; exiting 3"
    assert WorkerExit.decode(pod.exit.read_bytes()) == WorkerExit(POD.attempt, 3, why)
    assert why in pod.log.read_text(), "the worker's output still reaches the container log"
    assert launcher.poll() is None, "the launcher keeps the pod up"
    write_atomic(pod.assignment, NEWER.encode())
    assert pod.worker(2)["env"]["CTJ_ATTEMPT"] == str(NEWER.attempt)
    assert not pod.exit.exists(), "the new attempt starts with no exit reported"
    assert launcher.poll() is None


def test_a_worker_that_exits_0_ends_the_launcher_with_0(pod: Pod) -> None:
    assert pod.start("exit=0").wait(10) == 0
    assert not pod.exit.exists()


@pytest.mark.parametrize(("mode", "code"), [("trap-term=7", 7), ("idle", 128 + 15)])
def test_sigterm_is_forwarded_and_the_launcher_exits_as_the_worker(
    pod: Pod, mode: str, code: int
) -> None:
    launcher = pod.start(mode)
    worker = pod.worker(1)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(10) == code
    assert not alive(worker["pid"])


def link_to(target: Path, path: Path) -> None:
    """A link to ``target`` put in place of ``path`` at once."""
    link = path.with_name(".link")
    os.symlink(target, link)
    os.replace(link, path)


def fifo_at(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def test_hostile_assignment_files_are_ignored_and_the_worker_kept(pod: Pod, tmp_path: Path) -> None:
    launcher = pod.start("idle")
    first = pod.worker(1)
    elsewhere = tmp_path / "elsewhere.json"
    write_atomic(elsewhere, NEWER.encode())
    hostile: list[Callable[[], None]] = [
        lambda: write_atomic(pod.assignment, b"\x00\xffnot json at all"),
        lambda: write_atomic(pod.assignment, NEWER.encode() + b" " * 10_000),
        lambda: link_to(elsewhere, pod.assignment),
        lambda: fifo_at(pod.assignment),
        lambda: write_atomic(pod.assignment, replace(POD, attempt=1).encode()),
        lambda: write_atomic(pod.assignment, replace(NEWER, attempt=POD.attempt).encode()),
    ]
    for n, make in enumerate(hostile, start=1):
        make()
        wait_for(lambda: pod.ignored() >= n, f"hostile file {n} to be ignored")  # noqa: B023
    write_atomic(pod.assignment, NEWER.encode())
    second = pod.worker(2)
    assert second["env"]["CTJ_ATTEMPT"] == str(NEWER.attempt)
    assert not alive(first["pid"]) and launcher.poll() is None
    assert pod.ignored() == len(hostile), "one log line per file, not one per poll"


def test_the_launcher_imports_neither_torch_nor_the_engine() -> None:
    code = (
        "import trainer_sidecar.launcher, sys; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'trainer_sidecar'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(None),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert out.stdout.strip() == "['trainer_sidecar', 'trainer_sidecar.launcher']"


def test_without_a_staging_dir_the_command_runs_once(pod: Pod) -> None:
    assert pod.start("exit=3", staging=False).wait(10) == 3
    assert len(pod.reports()) == 1
    assert not (pod.staging / "launch").exists()
    assert "in-place restarts are off" in pod.log.read_text()


def test_a_restarted_launcher_starts_from_the_newest_assignment(pod: Pod) -> None:
    """A container restarted in its pod: the assignment it was last given beats the pod's
    environment, and the exit reported before is stale."""
    write_atomic(pod.assignment, NEWER.encode())
    write_atomic(pod.exit, WorkerExit(POD.attempt, 3).encode())
    pod.start("idle")
    assert pod.worker(1)["env"]["CTJ_ATTEMPT"] == str(NEWER.attempt)
    assert not pod.exit.exists()
