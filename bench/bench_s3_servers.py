"""What the loopback S3 servers themselves cost, side by side: moto and SeaweedFS.

The benchmarks run their S3 server on the same cores as the ranks (2 here), and the
pinned goodput run gives the server the checkpoint path's core, so the server's CPU per
byte decides what those figures can show. For each server (started fresh on loopback, as
the benchmarks start it) this counts the server process's CPU seconds (user + system,
every thread and child) over:

* ``PUT 8 MiB``: ``--objects`` objects of 8 MiB (our chunk size), 8 in flight, each with
  its CRC32 header and no payload signing, as our store sends them; per GiB;
* ``GET 8 MiB``: the same objects read back; per GiB;
* ``PUT 4 KiB``, ``HEAD``: ``--requests`` small requests each (manifests, parts,
  markers); per request;
* ``LIST``: pages of 100 keys, a tenth as many; per request.

The client's own CPU is not counted. Ratios: SeaweedFS ÷ moto, per phase.

Usage:

    source hack/env.sh
    python bench/bench_s3_servers.py --json /tmp/servers.json     # ~1 minute
"""

from __future__ import annotations

import argparse
import base64
import os
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import bench_checkpoint
from bench_async import process_cpu_seconds
from bench_checkpoint import CREDENTIALS, REGION, create_bucket, log, machine, s3_server
from ctj_devcluster.processes import descendants

SERVERS = ("moto", "seaweedfs")
MIB = 1 << 20
IN_FLIGHT = 8


def tree_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of ``pid`` and of any process it started."""
    return sum(process_cpu_seconds(p) for p in (pid, *descendants(pid)))


def client(endpoint: str) -> Any:
    import boto3
    import botocore.config

    config = botocore.config.Config(  # as trainer_sidecar/store/s3.py sends requests
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        max_pool_connections=2 * IN_FLIGHT,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=config,
    )


def crc32_header(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def measure_server(kind: str, objects: int, requests: int) -> dict[str, Any]:
    with s3_server(None, kind) as (endpoint, description, pid):
        assert pid is not None
        s3 = client(endpoint)
        bucket = create_bucket(endpoint)
        big, small = os.urandom(8 * MIB), os.urandom(4096)
        big_crc, small_crc = crc32_header(big), crc32_header(small)
        phases: dict[str, dict[str, float]] = {}

        def phase(name: str, call: Callable[[int], object], n: int, gib: float = 0.0) -> None:
            cpu, start = tree_cpu_seconds(pid), time.perf_counter()
            with ThreadPoolExecutor(IN_FLIGHT) as pool:
                list(pool.map(call, range(n)))
            seconds, cpu = time.perf_counter() - start, tree_cpu_seconds(pid) - cpu
            per = {"cpu_ms_per_request": 1e3 * cpu / n}
            if gib:
                per = {"cpu_seconds_per_gib": cpu / gib}
            phases[name] = {"seconds": seconds, "server_cpu_seconds": cpu, **per}
            log(f"{kind}: {name} {seconds:.2f} s, server {cpu:.2f} CPU-s")

        def put(key: str, body: bytes, crc: str) -> object:
            return s3.put_object(Bucket=bucket, Key=key, Body=body, ChecksumCRC32=crc)

        gib = objects * 8 * MIB / (1 << 30)
        phase("put_8mib", lambda i: put(f"big/{i}", big, big_crc), objects, gib)
        phase("get_8mib", lambda i: s3.get_object(Bucket=bucket, Key=f"big/{i}")["Body"].read(),
              objects, gib)  # fmt: skip
        phase("put_4kib", lambda i: put(f"small/{i}", small, small_crc), requests)
        phase("head", lambda i: s3.head_object(Bucket=bucket, Key=f"small/{i}"), requests)
        phase("list", lambda i: s3.list_objects_v2(Bucket=bucket, Prefix="small/", MaxKeys=100),
              max(1, requests // 10))  # fmt: skip
        return {"server": description, "phases": phases}


def run(opts: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    servers = {kind: measure_server(kind, opts.objects, opts.requests) for kind in opts.servers}
    ratios: dict[str, float] = {}
    if {"moto", "seaweedfs"} <= set(servers):
        for name, m in servers["moto"]["phases"].items():
            s = servers["seaweedfs"]["phases"][name]
            key = "cpu_seconds_per_gib" if "cpu_seconds_per_gib" in m else "cpu_ms_per_request"
            ratios[f"{name}_cpu_seaweedfs_vs_moto"] = s[key] / max(m[key], 1e-9)
    return {
        "command": " ".join(["python", "bench/bench_s3_servers.py", *opts.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": time.monotonic() - started,
        "config": {"objects": opts.objects, "requests": opts.requests, "in_flight": IN_FLIGHT},
        "machine": machine(),
        "servers": servers,
        "ratios": ratios,
        "targets": {},  # a measurement of the test servers; nothing of ours to judge
    }


def table(report: dict[str, Any]) -> str:
    kinds = list(report["servers"])
    lines = [f"{'server CPU':<28}" + "".join(f"{k:>14}" for k in kinds)]
    lines.append("-" * len(lines[0]))
    first = report["servers"][kinds[0]]["phases"]
    for name, figures in first.items():
        key = "cpu_seconds_per_gib" if "cpu_seconds_per_gib" in figures else "cpu_ms_per_request"
        unit = "CPU-s/GiB" if key == "cpu_seconds_per_gib" else "CPU-ms/request"
        row = "".join(f"{report['servers'][k]['phases'][name][key]:>14.2f}" for k in kinds)
        lines.append(f"{name + ' (' + unit + ')':<28}{row}")
    lines += ["", f"{'ratio':<40}{'value':>8}"]
    lines += [f"{name:<40}{value:>8.2f}" for name, value in report["ratios"].items()]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures and ratios here")
    parser.add_argument("--quick", action="store_true", help="few requests: a smoke run")
    parser.add_argument("--objects", type=int, default=128, help="8 MiB objects (default 128)")
    parser.add_argument("--requests", type=int, default=1000, help="small requests per phase")
    parser.add_argument(
        "--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="which to start"
    )
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.objects, opts.requests = 4, 20
    opts.argv = argv
    return opts


def main(argv: list[str] | None = None) -> int:
    return bench_checkpoint.script_main(argv, parse_args=parse_args, run=run, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
