#!/usr/bin/env python3
"""Cost against state size (issue 27): does a GiB cost the same at 8 GiB as at 1 GiB?

For each size (default 1, 2, 4 and 8 GiB of fp32 state) it runs, one after the other,
each with a fresh S3 server of its own:

* ``bench_checkpoint.py --no-s3torchconnector``: the stall (``save`` returning, the state
  staged), the full save to a commit, and loads at 2 -> 2, 2 -> 1 and 2 -> 3, each beside
  its raw boto3 anchor (one multipart upload per rank; GETs of the same bytes, dropped);
* ``bench_restore_tier.py --via mount``: the restore after a node loss (3 -> 2) from the
  node tier with replication, beside the S3-only restore.

It prints seconds per GiB for every phase at every size, for ours and for the anchor (and
the ranks' CPU-seconds per GiB, where bench_checkpoint measures them), and the ratio of
the largest size's per-GiB cost to the smallest's (target <= 1.15 for ours; the anchor's
is shown beside it: a server that slows down with size shows there too).
A size whose run fails (out of memory, say) is reported as failed; the others still run.
Where only the node-tier restore fails (its three node caches and their snapshots need
about 4x the state on disk), that size's other phases stand.

    python bench/bench_size_sweep.py --s3 seaweedfs --json /tmp/sweep.json   # 1-8 GiB
    python bench/bench_size_sweep.py --sizes 32,64 --json /tmp/sweep.json    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_checkpoint as bc

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
TARGET = 1.15
# phase: (ours, its anchor) as (phase name, field) in bench_checkpoint's report; the stall
# has no anchor there (bench_async.py compares it with the copy floor)
CHECKPOINT_PHASES: dict[str, tuple[tuple[str, str], tuple[str, str] | None]] = {
    "stall": (("save_ours_full", "returned_seconds"), None),
    "save": (("save_ours_full", "seconds"), ("save_boto3", "seconds")),
    "load_2to2": (("load_ours_w2", "seconds"), ("load_boto3_w2", "seconds")),
    "load_2to1": (("load_ours_w1", "seconds"), ("load_boto3_w1", "seconds")),
    "load_2to3": (("load_ours_w3", "seconds"), ("load_boto3_w3", "seconds")),
}
# the node tier's restore 3 -> 2 with replication, and the S3-only restore beside it
TIER_PHASE = ("node_tier_restore_3to2", "replicated_w2", "s3_only_w2")  # one --via: unsuffixed
PHASES = [*CHECKPOINT_PHASES, TIER_PHASE[0]]


def run_bench(script: str, args: list[str], log_path: Path) -> dict[str, Any]:
    """One benchmark run in its own process; its JSON report (RuntimeError if it failed)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = out.name
    cmd = [sys.executable, str(HERE / script), *args, "--json", path]
    bc.log(" ".join(["python", f"bench/{script}", *args]))
    try:
        with open(log_path, "a") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            tail = log_path.read_text()[-2000:]
            raise RuntimeError(f"{script} exited {done.returncode}:\n{tail}")
        report: dict[str, Any] = json.loads(Path(path).read_text())
        return report
    finally:
        os.unlink(path)


def seconds_by_phase(
    ckpt: dict[str, Any], tier: dict[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """Every phase's seconds, ours and the anchor's, with the bytes they cover, and the
    ranks' CPU-seconds where the benchmark measured them. Without the tier's report (its
    run failed) the node-tier phase is left out."""
    out: dict[str, dict[str, Any]] = {}
    total = ckpt["config"]["total_bytes"]
    for phase, ((ours, field), anchor) in CHECKPOINT_PHASES.items():
        row = {"bytes": total, "ours_seconds": ckpt["phases"][ours][field]}
        if field == "seconds" and "cpu_seconds" in ckpt["phases"][ours]:
            row["ours_cpu_seconds"] = ckpt["phases"][ours]["cpu_seconds"]
        if anchor is not None:
            row["anchor_seconds"] = ckpt["phases"][anchor[0]][anchor[1]]
            if "cpu_seconds" in ckpt["phases"][anchor[0]]:
                row["anchor_cpu_seconds"] = ckpt["phases"][anchor[0]]["cpu_seconds"]
        out[phase] = row
    if tier is not None:
        tier_phase, tiered, s3_only = TIER_PHASE
        out[tier_phase] = {
            "bytes": tier["config"]["total_bytes"],
            "ours_seconds": tier["variants"][tiered]["seconds_median"],
            "anchor_seconds": tier["variants"][s3_only]["seconds_median"],
        }
    for row in out.values():
        gib = row["bytes"] / GIB
        for who in ("ours", "anchor"):
            for what in ("seconds", "cpu_seconds"):
                if f"{who}_{what}" in row:
                    row[f"{who}_{what}_per_gib"] = row[f"{who}_{what}"] / gib
    return out


def growth(sizes: dict[int, dict[str, Any]]) -> dict[str, float]:
    """Per phase: per-GiB cost at the largest size where it ran over the smallest's, ours
    (judged) and the anchor's (shown beside)."""
    values: dict[str, float] = {}
    for phase in PHASES:
        ran = sorted(mib for mib, r in sizes.items() if phase in r.get("phases", {}))
        if len(ran) < 2:
            continue
        small, large = sizes[ran[0]]["phases"][phase], sizes[ran[-1]]["phases"][phase]
        key = f"{phase}_per_gib_ratio_{ran[-1]}mib_vs_{ran[0]}mib"
        values[key] = large["ours_seconds_per_gib"] / small["ours_seconds_per_gib"]
        if "anchor_seconds_per_gib" in small:
            values[f"anchor_{key}"] = (
                large["anchor_seconds_per_gib"] / small["anchor_seconds_per_gib"]
            )
    return values


def judge(values: dict[str, float]) -> dict[str, dict[str, Any]]:
    return {
        name: {"value": v, "target": f"<= {TARGET}", "met": v <= TARGET}
        for name, v in values.items()
        if not name.startswith("anchor_")
    }


def run(opts: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    s3 = ["--endpoint-url", opts.endpoint_url] if opts.endpoint_url else ["--s3", opts.s3]
    log_path = Path(tempfile.mkdtemp(prefix="ctj-bench-sweep-")) / "runs.log"
    bc.log(f"the runs' output: {log_path}")
    sizes: dict[int, dict[str, Any]] = {}
    for mib in opts.sizes:
        bc.log(f"--- {mib} MiB")
        size = ["--total-mib", str(mib)]
        try:
            ckpt = run_bench("bench_checkpoint.py", [*s3, *size, "--no-s3torchconnector"], log_path)
        except RuntimeError as exc:
            bc.log(f"{mib} MiB failed: {str(exc).splitlines()[0]}")
            sizes[mib] = {"failed": str(exc)}
            continue
        tier: dict[str, Any] | None = None
        try:
            tier = run_bench("bench_restore_tier.py",
                             [*s3, *size, "--via", "mount", "--repeats", str(opts.repeats)],
                             log_path)  # fmt: skip
        except RuntimeError as exc:  # the other phases stand (a full disk, say)
            bc.log(f"{mib} MiB: the node-tier restore failed: {str(exc).splitlines()[0]}")
        sizes[mib] = {"phases": seconds_by_phase(ckpt, tier), "engine": ckpt["engine"],
                      "server": ckpt["server"]}  # fmt: skip
        if tier is None:
            sizes[mib]["tier_failed"] = log_path.read_text()[-2000:]
    values = growth(sizes)
    return {
        "command": " ".join(["python", "bench/bench_size_sweep.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": time.monotonic() - started,
        "config": {"sizes_mib": opts.sizes, "tier_repeats": opts.repeats},
        "machine": bc.machine(),
        "sizes": {str(mib): r for mib, r in sizes.items()},
        "ratios": values,
        "targets": judge(values),
    }


def table(report: dict[str, Any]) -> str:
    sizes = report["sizes"]
    head = f"{'seconds per GiB':<26}" + "".join(f"{mib + ' MiB':>20}" for mib in sizes)
    lines = [head, f"{'(ours / raw anchor)':<26}", "-" * len(head)]
    for what, title in (("seconds", ""), ("cpu_seconds", "CPU-s per GiB")):
        if title:
            lines += ["", f"{title:<26}"]
        for phase in PHASES:
            cells = []
            for r in sizes.values():
                p = r.get("phases", {}).get(phase)
                if p is None or f"ours_{what}_per_gib" not in p:
                    failed = p is None and what == "seconds"
                    cells.append(f"{'failed' if failed else '':>20}")
                    continue
                anchor = p.get(f"anchor_{what}_per_gib")
                cell = f"{p[f'ours_{what}_per_gib']:.3f}" + (f" / {anchor:.3f}" if anchor else "")
                cells.append(f"{cell:>20}")
            if what == "seconds" or any(c.strip() for c in cells):
                lines.append(f"{phase:<26}" + "".join(cells))
    lines += bc.ratio_lines(report, width=58)
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures and ratios here")
    parser.add_argument(
        "--sizes", default="1024,2048,4096,8192", help="state sizes in MiB (default 1-8 GiB)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of the node-tier restore per size"
    )
    bc.add_s3_arguments(parser)
    opts = parser.parse_args(argv)
    opts.sizes = sorted(int(s) for s in opts.sizes.split(",") if s.strip())
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    report = run(opts)
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=2))
    print(table(report))
    failed = [mib for mib, r in report["sizes"].items() if "phases" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
