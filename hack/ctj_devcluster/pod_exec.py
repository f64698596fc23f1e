"""Turns this process into a pod's container: namespaces, mounts, then exec.

Run by the node agent as ``python pod_exec.py SPEC.json`` (by path, stdlib only, so that
nothing of ours is imported into, or left in the environment of, the container). It:

1. asks the kernel for a signal if the agent dies, and then SIGKILLs the container's whole
   process group (losing a node kills everything its containers started, grandchildren
   too; it is a child subreaper, so orphans stay its own),
2. enters new mount and UTS namespaces (we are root; no container runtime needed), makes
   every mount private, so nothing below leaks to the host,
3. sets the pod's hostname, bind-mounts the pod's volumes at their mountPaths (creating
   missing mount points on the host: empty directories, harmless) and the namespace's
   hosts file on /etc/hosts, which is how cluster DNS names resolve, then binds back any
   of the "image" roots (the Python environment, the checkout) a volume covered,
4. chdirs to workingDir, forks and execs the command with exactly the container's
   environment, waits for it (SIGTERM to the group reaches the command directly), then kills
   whatever the command left in the group and exits with its code (128+N for signal N).

Exit codes when the command cannot start: 126/127 (like a shell), 128 on setup failure.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
DEATH_SIGNAL = signal.SIGRTMIN + 2
"""Sent to us by the kernel when the agent dies; rare enough that no container uses it."""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _bind(source: str, target: str, read_only: bool, *, is_dir: bool | None = None) -> None:
    if os.path.isdir(source) if is_dir is None else is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
        if not os.path.exists(target):
            open(target, "a").close()
    _check(
        _libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None),
        f"bind {source} on {target}",
    )
    if read_only:
        _check(
            _libc.mount(
                None, target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None
            ),
            f"remount {target} read-only",
        )


def _kill_group_and_exit(*_: object) -> None:
    """The agent died (our PDEATHSIG): take the whole container down with us."""
    os.killpg(0, signal.SIGKILL)


def _others_in_group() -> list[int]:
    me, group = os.getpid(), os.getpgrp()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
            except (FileNotFoundError, IndexError, ProcessLookupError):
                continue
            if int(fields[2]) == group:
                pids.append(int(entry))
    return pids


def setup(spec: dict) -> None:
    # Order matters: the handler before the death signal, the signal before the check.
    signal.signal(DEATH_SIGNAL, _kill_group_and_exit)
    _check(_libc.prctl(PR_SET_PDEATHSIG, DEATH_SIGNAL, 0, 0, 0), "prctl")
    if os.getppid() != spec["agent_pid"]:  # the agent died before prctl took effect
        os._exit(137)
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl subreaper")
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    hostname = spec["hostname"].encode()
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
    # Every source is opened before anything is mounted: pods share the host's files here,
    # so a mount over a directory that holds other sources (an emptyDir on /tmp, where the
    # pods' volumes live) would hide them from the binds after it. A kubelet's sources are
    # outside the container's root and never hidden; binding from /proc/self/fd does the same.
    binds = [(m["source"], m["target"], m.get("read_only", False)) for m in spec["mounts"]]
    if spec.get("hosts_file"):
        binds.append((spec["hosts_file"], "/etc/hosts", True))
    opened = [
        (os.open(source, os.O_PATH), os.path.isdir(source), target, ro)
        for source, target, ro in binds
    ]
    # The "image" here is the host's own files (the Python environment, the checkout): a
    # volume mounted over a directory that holds them (an emptyDir on /tmp, with the
    # checkout under /tmp) would hide the container's own code. Each such root is bound
    # back onto itself over the volume, as an image's files would stay in a real runtime.
    covered = [
        (os.open(root, os.O_PATH), root)
        for root in spec.get("image_roots", ())
        if os.path.isdir(root) and any(_under(root, target) for _, _, target, _ in opened)
    ]
    for fd, is_dir, target, read_only in opened:
        _bind(f"/proc/self/fd/{fd}", target, read_only, is_dir=is_dir)
        os.close(fd)
    for fd, root in covered:
        _bind(f"/proc/self/fd/{fd}", root, False, is_dir=True)
        os.close(fd)
    os.chdir(spec.get("working_dir") or "/")


def _under(path: str, mount: str) -> bool:
    """Whether ``path`` is ``mount`` or lies below it."""
    mount = mount.rstrip("/") or "/"
    return path == mount or path.startswith(mount if mount == "/" else mount + "/")


def _exec(argv: list[str], env: dict[str, str]) -> None:
    """In the forked child: become the container's command."""
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        print(
            f"ctj pod_exec: {argv[0]}: executable file not found in $PATH ({env.get('PATH', '')})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(127)
    except OSError as exc:
        print(f"ctj pod_exec: exec {argv[0]}: {exc}", file=sys.stderr, flush=True)
        os._exit(126)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        setup(spec)
    except OSError as exc:
        print(f"ctj pod_exec: container setup failed: {exc}", file=sys.stderr, flush=True)
        os._exit(128)
    # SIGTERM/SIGINT reach the command through the process group; we only outlive it.
    # (A handler, not SIG_IGN: handlers are reset by exec, ignored signals would be inherited.)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    child = os.fork()
    if child == 0:
        for reset in (DEATH_SIGNAL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(reset, signal.SIG_DFL)
        _exec(spec["argv"], spec["env"])
    while True:  # as a subreaper we also reap orphaned grandchildren
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(status)
    # A container ends with its main process: what it left running goes too.
    for pid in _others_in_group():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        while os.waitpid(-1, 0):
            pass
    except ChildProcessError:
        pass
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
