"""``python -m ctj_devcluster up|down|status``: the local cluster for the demo.

``up`` starts the cluster in the background (a detached supervisor process that owns every
component: if it dies, they die) and returns once it is ready, printing the KUBECONFIG to
use; ``up --foreground`` runs the supervisor in the terminal until Ctrl-C. ``down`` stops
it, ``status`` says whether it runs. State lives in ``--dir`` (default
``$CTJ_DEVCLUSTER_DIR`` or /tmp/ctj-devcluster), wiped by the next ``up``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .binaries import BinariesMissing
from .cluster import Cluster, ClusterConfig
from .kubeflow import KubeflowController


def _state(root: Path) -> dict | None:
    try:
        return json.loads((root / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a detached supervisor's parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


def _running(root: Path) -> dict | None:
    state = _state(root)
    return state if state and _alive(int(state["pid"])) and (root / "ready").exists() else None


def _print_ready(state: dict) -> None:
    kubectl_dir = os.path.dirname(state["kubectl"])
    print(
        f"ctj dev cluster is up ({len(state['nodes'])} nodes: {', '.join(state['nodes'])}; "
        f"started in {state['started_in_seconds']}s)"
    )
    print(f"export KUBECONFIG={state['kubeconfig']}")
    print(f"export PATH={kubectl_dir}:{os.path.dirname(state['helm'])}:$PATH")


def serve(args: argparse.Namespace) -> int:
    root: Path = args.dir
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    gpus = {args.gpu_resource: str(args.gpus)} if args.gpus else {}
    entrypoints = {}
    for item in args.image_entrypoint:
        repository, sep, command = item.partition("=")
        if not sep or not command.strip():
            raise SystemExit(f"--image-entrypoint {item!r}: expected REPOSITORY=COMMAND")
        entrypoints[repository] = shlex.split(command)
    cluster = Cluster(
        ClusterConfig(
            root=root,
            nodes=args.nodes,
            node_extended_resources=gpus,
            node_monitor_grace_period=args.node_grace,
            image_entrypoints=entrypoints,
        )
    )
    kubeflow = None
    try:
        cluster.start()
        if args.kubeflow:
            kubeflow = KubeflowController(cluster, root / "kubeflow")
            kubeflow.install()
            kubeflow.start()
            print(f"Kubeflow PyTorchJob controller running, log {kubeflow.log_path}")
        (root / "ready").touch()
        state = _state(root)
        assert state is not None
        _print_ready(state)
        sys.stdout.flush()
        while not stop.wait(1.0):
            cluster.control_plane.check_alive()
    finally:
        if kubeflow is not None:
            kubeflow.stop()
        cluster.stop()
        (root / "ready").unlink(missing_ok=True)
    return 0


def up(args: argparse.Namespace) -> int:
    root: Path = args.dir
    if (state := _running(root)) is not None:
        _print_ready(state)
        return 0
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    if args.foreground:
        return serve(args)
    argv = [
        sys.executable,
        "-m",
        "ctj_devcluster",
        "up",
        "--foreground",
        f"--dir={root}",
        f"--nodes={args.nodes}",
        f"--gpus={args.gpus}",
        f"--gpu-resource={args.gpu_resource}",
        f"--node-grace={args.node_grace}",
        *(f"--image-entrypoint={e}" for e in args.image_entrypoint),
        *(["--kubeflow"] if args.kubeflow else []),
    ]
    log = root / "devcluster.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(f"starting the ctj dev cluster in {root} (log: {log}) ...", file=sys.stderr)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(log.read_text()[-4000:], file=sys.stderr)
            print(f"the cluster failed to start (exit {proc.returncode})", file=sys.stderr)
            return 1
        if (state := _running(root)) is not None:
            _print_ready(state)
            return 0
        time.sleep(0.2)
    print("timed out waiting for the cluster; see the log", file=sys.stderr)
    return 1


def down(args: argparse.Namespace) -> int:
    state = _state(args.dir)
    if state is None or not _alive(int(state["pid"])):
        print("ctj dev cluster is not running")
        return 0
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)  # its components die with it (PR_SET_PDEATHSIG)
    print("ctj dev cluster stopped")
    return 0


def status(args: argparse.Namespace) -> int:
    state = _running(args.dir)
    if state is None:
        print("ctj dev cluster is not running")
        return 3
    _print_ready(state)
    subprocess.run(
        [state["kubectl"], "--kubeconfig", state["kubeconfig"], "get", "nodes"], check=False
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ctj_devcluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("CTJ_DEVCLUSTER_DIR", "/tmp/ctj-devcluster")),
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument(
        "--gpus", type=int, default=0, help="extended resource count per node standing in for GPUs"
    )
    parser.add_argument("--gpu-resource", default="nvidia.com/gpu")
    parser.add_argument(
        "--node-grace",
        type=float,
        default=10.0,
        help="seconds without heartbeats before a node is NotReady",
    )
    parser.add_argument(
        "--image-entrypoint",
        action="append",
        default=[],
        metavar="REPOSITORY=COMMAND",
        help="command for containers of this image that give none (there are no images "
        "here), e.g. ghcr.io/ctj/operator='python -m ctj_operator'; repeatable",
    )
    parser.add_argument(
        "--kubeflow",
        action="store_true",
        help="also run the Kubeflow PyTorchJob controller (for spec.backend: pytorchjob)",
    )
    parser.add_argument(
        "--foreground", action="store_true", help="up: run in this terminal until Ctrl-C"
    )
    args = parser.parse_args(argv)
    try:
        return {"up": up, "down": down, "status": status}[args.command](args)
    except BinariesMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
