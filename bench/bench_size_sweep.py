#!/usr/bin/env python3
"""Cost against state size (issue 27): does a GiB cost the same at 8 GiB as at 1 GiB?

For each size (default 1, 2, 4 and 8 GiB of fp32 state) it runs, one after the other,
each with a fresh S3 server of its own:

* ``bench_checkpoint.py --no-s3torchconnector``: the stall (``save`` returning, the state
  staged), the full save to a commit, and loads at 2 -> 2, 2 -> 1 and 2 -> 3, each beside
  its raw boto3 anchor (one multipart upload per rank; GETs of the same bytes, dropped);
* ``bench_restore_tier.py --via agent``: the restore after a node loss (3 -> 2) from the
  node tier with replication, beside the S3-only restore.

It prints seconds per GiB for every phase at every size, for ours and for the anchor, and
the ratio of the largest size's per-GiB cost to the smallest's (target <= 1.15 for ours;
the anchor's is shown beside it: a server that slows down with size shows there too).
A size whose run fails (out of memory, say) is reported as failed; the others still run.

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
TIER_PHASE = ("node_tier_restore_3to2", "replicated_w2", "s3_only_w2")  # --via agent: unsuffixed
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


def seconds_by_phase(ckpt: dict[str, Any], tier: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every phase's seconds, ours and the anchor's, with the bytes they cover."""
    out: dict[str, dict[str, Any]] = {}
    total = ckpt["config"]["total_bytes"]
    for phase, ((ours, field), anchor) in CHECKPOINT_PHASES.items():
        row = {"bytes": total, "ours_seconds": ckpt["phases"][ours][field]}
        if anchor is not None:
            row["anchor_seconds"] = ckpt["phases"][anchor[0]][anchor[1]]
        out[phase] = row
    tier_phase, tiered, s3_only = TIER_PHASE
    out[tier_phase] = {
        "bytes": tier["config"]["total_bytes"],
        "ours_seconds": tier["variants"][tiered]["seconds_median"],
        "anchor_seconds": tier["variants"][s3_only]["seconds_median"],
    }
    for row in out.values():
        gib = row["bytes"] / GIB
        row["ours_seconds_per_gib"] = row["ours_seconds"] / gib
        if "anchor_seconds" in row:
            row["anchor_seconds_per_gib"] = row["anchor_seconds"] / gib
    return out


def growth(sizes: dict[int, dict[str, Any]]) -> dict[str, float]:
    """Per phase: per-GiB cost at the largest size that ran over the smallest's, ours
    (judged) and the anchor's (shown beside)."""
    ran = sorted(mib for mib, r in sizes.items() if "phases" in r)
    if len(ran) < 2:
        return {}
    small, large = sizes[ran[0]]["phases"], sizes[ran[-1]]["phases"]
    values: dict[str, float] = {}
    for phase in PHASES:
        key = f"{phase}_per_gib_ratio_{ran[-1]}mib_vs_{ran[0]}mib"
        values[key] = large[phase]["ours_seconds_per_gib"] / small[phase]["ours_seconds_per_gib"]
        if "anchor_seconds_per_gib" in small[phase]:
            values[f"anchor_{key}"] = (
                large[phase]["anchor_seconds_per_gib"] / small[phase]["anchor_seconds_per_gib"]
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
        try:
            size = ["--total-mib", str(mib)]
            ckpt = run_bench("bench_checkpoint.py", [*s3, *size, "--no-s3torchconnector"], log_path)
            tier = run_bench("bench_restore_tier.py",
                             [*s3, *size, "--via", "agent", "--repeats", str(opts.repeats)],
                             log_path)  # fmt: skip
        except RuntimeError as exc:
            bc.log(f"{mib} MiB failed: {str(exc).splitlines()[0]}")
            sizes[mib] = {"failed": str(exc)}
            continue
        sizes[mib] = {"phases": seconds_by_phase(ckpt, tier), "engine": ckpt["engine"],
                      "server": ckpt["server"]}  # fmt: skip
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
    for phase in PHASES:
        cells = []
        for r in sizes.values():
            if "phases" not in r:
                cells.append(f"{'failed':>20}")
                continue
            p = r["phases"][phase]
            anchor = p.get("anchor_seconds_per_gib")
            cell = f"{p['ours_seconds_per_gib']:.3f}" + (f" / {anchor:.3f}" if anchor else "")
            cells.append(f"{cell:>20}")
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
