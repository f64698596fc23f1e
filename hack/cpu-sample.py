#!/usr/bin/env python3
"""Where the test command's CPU goes: every process's CPU time, sampled, by component.

    python3 hack/cpu-sample.py OUT.txt &   # beside `CI=true bash .ci/run`
    kill -TERM %1                          # when it ends: OUT.txt has the table

Every 2 s it reads utime + stime of every process in /proc (the kind nodes' containers
included: their processes are this machine's too) and keeps each process's last value,
with its command line (read again while it is still `runc init`, before the container's
exec); what a process had spent before the first sample is not counted. At SIGTERM or
SIGINT it writes CPU-seconds per component (the rules below, first match) and the 40
busiest processes. A process that lives less than 2 s, and the last 2 s of every
process, are missed: the totals are a lower bound, good for ranking components. Reading
/proc every 2 s costs about 1 % of a core. Stdlib only.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")
RULES = [  # (component, regex on the command line), first match wins
    ("trainer standby (CTJ_PRELOAD)", r"runpy"),
    ("ctj sidecar", r"trainer_sidecar sidecar|ctj sidecar"),
    ("ctj cli", r"-m trainer_sidecar|trainer_sidecar checkpoints"),
    ("operator", r"ctj_operator|kopf"),
    ("trainer", r"train_fsdp|torchrun|trainer_sidecar\.launcher"),
    ("integration ranks", r"tests\.integration|rank_preload|chaos_worker"),
    ("bench", r"bench/"),
    ("pytest (the tiers' own processes)", r"pytest"),
    ("simulated node agents", r"ctj_devcluster\.node|ctj_devcluster "),
    ("S3 servers (loopback)", r"local_s3|moto"),
    ("kube-apiserver", r"kube-apiserver"),
    ("etcd", r"\betcd\b"),
    ("kube-controller-manager, kube-scheduler", r"kube-controller|kube-scheduler"),
    ("kubelet", r"\bkubelet\b"),
    ("containerd, runc", r"containerd|runc"),
    ("SeaweedFS", r"\bweed\b"),
    ("controllers (Kubeflow, Kueue, JobSet)", r"manager|training-operator|kueue|jobset"),
    ("kubectl, helm", r"kubectl|\bhelm\b"),
    ("other Python", r"python"),
]


def component(cmd: str) -> str:
    for name, rule in RULES:
        if re.search(rule, cmd):
            return name
    return "other: " + os.path.basename(cmd.split(" ")[0])[:30]


def main(out: str) -> None:
    seen: dict[tuple[str, str], tuple[float, str]] = {}  # (pid, start) -> (cpu s, command)
    before: dict[tuple[str, str], float] = {}  # what the first sweep's processes had spent
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    started = time.time()
    first = True
    while not stop:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rfind(")") + 2 :].split()
                cpu, key = (int(fields[11]) + int(fields[12])) / HZ, (pid, fields[19])
                cmd = seen[key][1] if key in seen else ""
                if not cmd or cmd.startswith("runc init"):
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        raw = f.read().replace(b"\0", b" ").decode(errors="replace")
                    cmd = raw[:300] or stat[stat.find("(") + 1 : stat.rfind(")")]
                seen[key] = (cpu, cmd)
                if first:
                    before[key] = cpu
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
        first = False
        time.sleep(2)
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    spent = {key: (cpu - before.get(key, 0.0), cmd) for key, (cpu, cmd) in seen.items()}
    for (pid, _), (cpu, cmd) in spent.items():
        if pid != str(os.getpid()) and cpu > 0:
            total[component(cmd)] += cpu
            count[component(cmd)] += 1
    with open(out, "w") as f:
        f.write(f"# {time.time() - started:.0f} s sampled; {sum(total.values()):.0f} CPU-s\n")
        f.write("# CPU-s  processes  component\n")
        for name, cpu in sorted(total.items(), key=lambda item: -item[1]):
            f.write(f"{cpu:8.0f}  {count[name]:9d}  {name}\n")
        f.write("\n# the busiest processes\n")
        for cpu, cmd in sorted(spent.values(), reverse=True)[:40]:
            f.write(f"{cpu:8.0f}  {cmd[:200]}\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
