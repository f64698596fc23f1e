"""One pod on a simulated node: its containers as host processes, its status reported.

A PodWorker is a thread per pod, the kubelet's pod worker in miniature: it prepares the
pod (IP, volumes), runs init containers in order (``restartPolicy: Always`` ones, native
sidecars, are started and left running), starts the regular containers, restarts them per
the pod's restartPolicy with a capped backoff, reports status whenever it changes, and on
deletion stops the containers (SIGTERM, grace period, SIGKILL) and removes the pod.

Containers are started by ``pod_exec.py`` (namespaces, mounts, exec). The thread that
starts them is this worker, and it outlives them: PR_SET_PDEATHSIG fires when the starting
*thread* exits, so a worker must not return while its processes run.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from . import podspec, volumes
from .node_config import NodeAgentConfig
from .pod_api import PodApi, now_rfc3339
from .podspec import ConfigError, Obj
from .processes import signal_tree

log = logging.getLogger(__name__)
POD_EXEC = Path(__file__).with_name("pod_exec.py")


@functools.cache
def image_roots() -> list[str]:
    """What a container's image is made of here: this Python environment and the checkout
    its code is installed from (editable: wherever test.sh last ran). Asked of the
    container's own Python (no PYTHONPATH, cwd /), which may find it elsewhere than this
    process does. pod_exec binds back any of them a volume covers."""
    roots = {sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parents[2])}
    ask = "import importlib.util as u; s = u.find_spec('trainer_sidecar'); print(s and s.origin)"
    found = subprocess.run(
        [sys.executable, "-c", ask], cwd="/", env={"PATH": os.environ.get("PATH", "")},
        capture_output=True, text=True, timeout=60, check=False,
    ).stdout.strip()  # fmt: skip
    if found and found != "None":
        roots.add(str(Path(found).resolve().parents[1]))
    return sorted(roots)


SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


TERMINATION_LOG_LINES, TERMINATION_LOG_BYTES = 80, 2048
"""What the kubelet keeps of a failed container's log as its termination message under
terminationMessagePolicy FallbackToLogsOnError (no message file is read here): the last 80
lines, at most the last 2048 bytes."""


def log_tail(path: Path) -> str:
    """The end of a container's log, as FallbackToLogsOnError keeps it ("" if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TERMINATION_LOG_BYTES))
            tail = f.read()
    except OSError:
        return ""
    lines = tail.decode("utf-8", "replace").splitlines()[-TERMINATION_LOG_LINES:]
    return "\n".join(lines)


class PodHost(Protocol):
    """What a PodWorker needs of the node agent that runs it (node_agent.NodeAgent)."""

    config: NodeAgentConfig
    node_ip: str
    pod_api: PodApi
    allocatable: dict[str, Any]

    def hosts_file(self, pod: Obj, pod_ip: str) -> Path: ...

    def pod_finished(self, worker: PodWorker) -> None: ...


@dataclass
class Container:
    """Runtime state of one container (regular or init)."""

    spec: Obj
    init: bool = False
    proc: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restart_count: int = 0
    last_terminated: dict[str, Any] | None = None
    terminated: dict[str, Any] | None = None
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    next_start: float = 0.0
    done: bool = False
    """Finished for good (will not be restarted)."""

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def sidecar(self) -> bool:
        return self.init and self.spec.get("restartPolicy") == "Always"

    def status(self, node: str) -> dict[str, Any]:
        running = self.proc is not None and self.terminated is None
        state: dict[str, Any] = {"waiting": None, "running": None, "terminated": None}
        if running:
            state["running"] = {"startedAt": self.started_at}
        elif self.terminated is not None:
            state["terminated"] = self.terminated
        else:
            state["waiting"] = {
                "reason": self.waiting_reason,
                **({"message": self.waiting_message} if self.waiting_message else {}),
            }
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image") or "none",
            "imageID": "",
            "ready": running,
            "started": running,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.proc is not None:
            status["containerID"] = f"ctj://{node}/{self.proc.pid}"
        return status


@dataclass
class PodWorker:
    agent: PodHost
    pod: Obj
    pod_ip: str
    containers: list[Container] = field(default_factory=list)
    init_containers: list[Container] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _grace: float = 30.0
    _last_status: str = ""
    _start_time: str = field(default_factory=now_rfc3339)
    _prepared: bool = False
    _finishing: bool = False
    """The pod is done: containers that exit now are not restarted."""
    _conditions: dict[str, tuple[bool, str]] = field(default_factory=dict)
    _volume_paths: dict[str, Path] = field(default_factory=dict)
    thread: threading.Thread | None = None
    delete_when_stopped: bool = False

    def __post_init__(self) -> None:
        spec = self.pod["spec"]
        self.init_containers = [Container(c, init=True) for c in spec.get("initContainers") or []]
        self.containers = [Container(c) for c in spec.get("containers") or []]
        meta = self.pod["metadata"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        pod_dir = f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        self.dir = self.agent.config.root / "pods" / pod_dir
        self.shm_dir = Path(self.agent.config.shm_root) / meta["uid"]

    # --- called from the agent's event handler ---------------------------------------
    def start(self) -> PodWorker:
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)
        self.thread.start()
        return self

    def update(self, pod: Obj) -> None:
        self.pod = pod

    def request_stop(self, grace: float, *, delete: bool) -> None:
        """Stop the containers (SIGTERM, ``grace`` seconds, SIGKILL); with ``delete``, then
        remove the pod object, as a kubelet finishes a graceful deletion."""
        self._grace = grace
        self.delete_when_stopped = delete
        self._stop.set()

    def _addresses(self) -> dict[str, Any]:
        return {
            "hostIP": self.agent.node_ip,
            "hostIPs": [{"ip": self.agent.node_ip}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
        }

    # --- the worker thread -------------------------------------------------------------
    @property
    def restart_policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy") or "Always")

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("pod %s: worker crashed", self.key)
        finally:
            self._kill_all(self._grace)
            self.agent.pod_finished(self)

    def _loop(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._report()
        while not self._stop.is_set():
            if not self._prepared and not self._prepare():
                self._stop.wait(2.0)
                continue
            self._step()
            if self._phase() in ("Succeeded", "Failed"):
                # Native sidecars are stopped (SIGTERM, grace period) before the pod is
                # reported done, as the kubelet does.
                grace = self.pod["spec"].get("terminationGracePeriodSeconds")
                self._finishing = True
                self._kill_all(30.0 if grace is None else float(grace))
                self._report()
                self._stop.wait()
                break
            self._report()
            self._stop.wait(0.1)
        self._kill_all(self._grace)
        self._report(final=True)

    def _prepare(self) -> bool:
        try:
            self._volume_paths = volumes.materialize(
                self.pod,
                self.dir,
                get_secret=self.agent.pod_api.get_secret,
                get_config_map=self.agent.pod_api.get_config_map,
                request_token=self.agent.pod_api.request_token,
                shm_dir=self.shm_dir,
                host_root=self.agent.config.root / "host",
            )
            self._prepared = True
        except Exception as exc:  # ConfigError or an API error: reported on the pod, retried
            log.warning("pod %s: cannot prepare volumes: %s", self.key, exc)
            for c in self.init_containers + self.containers:
                c.waiting_reason, c.waiting_message = "CreateContainerConfigError", str(exc)
            self._report()
        return self._prepared

    def _step(self) -> None:
        for c in self.init_containers + self.containers:
            self._reap(c)
        pending_init = [c for c in self.init_containers if not c.sidecar and not c.done]
        for c in self.init_containers:
            if c.sidecar and c.proc is None and not c.done:
                self._maybe_start(c)
            elif c is (pending_init[0] if pending_init else None) and c.proc is None:
                self._maybe_start(c)
                return
            elif not c.sidecar and not c.done:
                return  # an init container is still running
        if any(
            c.init and not c.sidecar and c.terminated and c.terminated["exitCode"] != 0 and c.done
            for c in self.init_containers
        ):
            return  # init failed for good: the pod fails
        for c in self.containers:
            if c.proc is None and not c.done:
                self._maybe_start(c)

    def _maybe_start(self, c: Container) -> None:
        if time.monotonic() < c.next_start:
            return
        try:
            # the addresses as the kubelet knows them, not as the watch last delivered
            # them: a container started before our first status write must see its pod IP
            known = {**self.pod, "status": {**(self.pod.get("status") or {}), **self._addresses()}}
            env = podspec.container_env(
                known,
                c.spec,
                base=self._base_env(),
                get_secret=self.agent.pod_api.get_secret,
                get_config_map=self.agent.pod_api.get_config_map,
                node_allocatable=self.agent.allocatable,
            )
            argv = podspec.container_argv(c.spec, env, self.agent.config.image_entrypoints)
            mounts = volumes.container_mounts(c.spec, self._volume_paths)
        except ConfigError as exc:
            c.waiting_reason, c.waiting_message = "CreateContainerConfigError", str(exc)
            c.next_start = time.monotonic() + 2.0
            self.agent.pod_api.record_event(self.pod, "Warning", "Failed", f"Error: {exc}")
            return
        exec_spec = {
            "agent_pid": os.getpid(),
            "hostname": self.pod["spec"].get("hostname") or self.pod["metadata"]["name"],
            "mounts": mounts,
            "hosts_file": str(self.agent.hosts_file(self.pod, self.pod_ip)),
            "image_roots": image_roots(),
            "working_dir": c.spec.get("workingDir") or "/",
            "argv": argv,
            "env": env,
        }
        spec_path = self.dir / f"{c.name}.exec.json"  # holds secrets: owner-only
        fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(exec_spec, f)
        log_path = self.dir / f"{c.name}.log"
        with open(log_path, "ab") as out:
            c.proc = subprocess.Popen(
                [sys.executable, "-S", str(POD_EXEC), str(spec_path)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                start_new_session=True,
            )
        c.started_at, c.terminated, c.waiting_message = now_rfc3339(), None, ""
        log.info("pod %s: started container %s (pid %d)", self.key, c.name, c.proc.pid)
        self.agent.pod_api.record_event(
            self.pod, "Normal", "Started", f"Started container {c.name}"
        )

    def _reap(self, c: Container) -> None:
        if c.proc is None or c.terminated is not None:
            return
        code = c.proc.poll()
        if code is None:
            return
        exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128+N
        c.terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": f"ctj://{self.agent.config.name}/{c.proc.pid}",
        }
        if exit_code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = log_tail(self.dir / f"{c.name}.log")
            if message:
                c.terminated["message"] = message
        log.info("pod %s: container %s exited %d", self.key, c.name, exit_code)
        policy = (
            "Always"
            if c.sidecar
            else (
                "OnFailure" if c.init and self.restart_policy == "Always" else self.restart_policy
            )
        )
        if self._stop.is_set() or self._finishing or not podspec.should_restart(policy, exit_code):
            c.done = True
            return
        backoff = min(
            self.agent.config.restart_backoff * 2**c.restart_count,
            self.agent.config.max_restart_backoff,
        )
        c.next_start = time.monotonic() + backoff
        c.last_terminated, c.restart_count = c.terminated, c.restart_count + 1
        c.proc, c.terminated = None, None
        c.waiting_reason = "CrashLoopBackOff"
        self.agent.pod_api.record_event(
            self.pod, "Warning", "BackOff", f"Back-off {backoff:.0f}s restarting container {c.name}"
        )

    def _base_env(self) -> dict[str, str]:
        cfg = self.agent.config
        return {
            "PATH": f"{cfg.python_bin_dir}:{SYSTEM_PATH}",
            "HOSTNAME": self.pod["spec"].get("hostname") or self.pod["metadata"]["name"],
            "KUBERNETES_SERVICE_HOST": cfg.api_host,
            "KUBERNETES_SERVICE_PORT": str(cfg.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(cfg.api_port),
            "HOME": "/root",
        }

    def _phase(self) -> str:
        if not self._prepared:
            return "Pending"
        for c in self.init_containers:
            if not c.sidecar and c.done and c.terminated and c.terminated["exitCode"] != 0:
                return "Failed"
        if all(
            c.proc is None and c.terminated is None and c.restart_count == 0
            for c in self.containers
        ):
            return "Pending"
        codes = {
            c.name: (c.terminated["exitCode"] if c.done and c.terminated else None)
            for c in self.containers
        }
        return podspec.pod_phase(self.restart_policy, codes)

    def _kill_all(self, grace: float) -> None:
        """A kubelet's termination: the regular containers first (SIGTERM, then SIGKILL at
        the deadline), then the native sidecars in reverse order with what is left of the
        grace period (at least 2 s), so a sidecar outlives the containers it serves."""
        deadline = time.monotonic() + grace
        sidecars = [c for c in self.init_containers if c.sidecar]
        others = [c for c in self.init_containers + self.containers if c not in sidecars]
        self._terminate(others, deadline)
        self._terminate(list(reversed(sidecars)), max(deadline, time.monotonic() + 2.0))
        for c in self.init_containers + self.containers:
            self._reap(c)
            if c.terminated is not None:
                c.done = True

    def _terminate(self, containers: list[Any], deadline: float) -> None:
        running = [c for c in containers if c.proc is not None and c.proc.poll() is None]
        for c in running:
            self.agent.pod_api.record_event(
                self.pod, "Normal", "Killing", f"Stopping container {c.name}"
            )
            _signal_group(c.proc, signal.SIGTERM)
        for c in running:
            assert c.proc is not None
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(c.proc, signal.SIGKILL)
            c.proc.wait()

    def _condition(self, kind: str, ok: bool, reason: str) -> dict[str, Any]:
        """A pod condition whose lastTransitionTime moves only when its status does."""
        previous = self._conditions.get(kind)
        if previous is None or previous[0] != ok:
            self._conditions[kind] = previous = (ok, now_rfc3339())
        cond = {
            "type": kind,
            "status": "True" if ok else "False",
            "lastTransitionTime": previous[1],
        }
        if not ok:
            cond["reason"] = reason
        return cond

    def _report(self, final: bool = False) -> None:
        phase = self._phase()
        if final and phase not in ("Succeeded", "Failed"):
            # Stopped for deletion: the kubelet reports a terminal phase before removal.
            ok = all(c.terminated and c.terminated["exitCode"] == 0 for c in self.containers)
            phase = "Succeeded" if ok and self.containers else "Failed"
        terminal = phase in ("Succeeded", "Failed")
        node = self.agent.config.name
        ready = (
            not terminal
            and bool(self.containers)
            and all(c.proc is not None and c.terminated is None for c in self.containers)
        )
        initialized = self._prepared and all(c.done or c.sidecar for c in self.init_containers)
        not_ready = "PodCompleted" if terminal else "ContainersNotReady"
        status: dict[str, Any] = {
            "phase": phase,
            **self._addresses(),
            "startTime": self._start_time,
            "conditions": [
                self._condition(
                    "PodReadyToStartContainers", self._prepared and not terminal, "PodNotReady"
                ),
                self._condition("Initialized", initialized, "ContainersNotInitialized"),
                self._condition("ContainersReady", ready, not_ready),
                self._condition("Ready", ready, not_ready),
            ],
            "containerStatuses": [c.status(node) for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status(node) for c in self.init_containers]
        fingerprint = json.dumps(status, sort_keys=True)
        if fingerprint != self._last_status and self.agent.pod_api.patch_pod_status(
            self.pod, status
        ):
            self._last_status = fingerprint


def _signal_group(proc: subprocess.Popen[bytes] | None, sig: signal.Signals) -> None:
    if proc is not None:
        signal_tree(proc.pid, sig)
