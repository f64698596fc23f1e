"""The ``ctj`` command: inspect and manage a job's checkpoints.

    ctj checkpoints ls|show|verify|gc|rm|export URI ...

A user mistake (bad URI, missing bucket, wrong credentials, unknown step)
prints one line, ``ctj: error: ...``, and exits 2; a corrupt checkpoint found
by ``verify`` exits 1. Long work shows a progress bar on a terminal.

One bad checkpoint never hides the others: a manifest that cannot be read is a row
``step N: unreadable: <reason>`` in ``ls``, ``show`` and ``verify``, which go on with
the rest (``verify`` then exits 1, ``show --step N`` of that one too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from tqdm import tqdm

from .errors import (
    CheckpointError,
    CorruptManifestError,
    NoCheckpointError,
    UnsafeCheckpointError,
)
from .format.manifest import Manifest
from .parts import job_store
from .store import repository as repo
from .store.base import ObjectStore


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(ts: float) -> str:
    s = max(0, int(time.time() - ts))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


@contextmanager
def _progress(total: int, desc: str) -> Iterator[Callable[[int], None]]:
    with tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, disable=None, file=sys.stderr
    ) as bar:
        yield bar.update


def _store(args: argparse.Namespace) -> ObjectStore:
    return job_store(args.uri, endpoint_url=args.endpoint_url)


def _manifest(store: ObjectStore, step: int | None) -> Manifest:
    if step is not None:
        return repo.read_manifest(store, step)
    latest = _newest_readable(store)
    if latest is None:
        raise NoCheckpointError("no committed checkpoint at this location")
    return latest


def _newest_readable(store: ObjectStore) -> Manifest | None:
    """The newest checkpoint whose manifest reads (what a load starts from); each newer one
    that does not is named on stderr."""
    for step in reversed(repo.committed_steps(store)):
        read = _read(store, step)
        if isinstance(read, Manifest):
            return read
        if read is not None:
            print(f"step {step}: unreadable: {read.reason}", file=sys.stderr)
    return None


def _read(store: ObjectStore, step: int) -> Manifest | repo.UnreadableManifest | None:
    """One listed checkpoint's manifest; why it cannot be read; or None when it went
    since the listing (retention or ``rm`` retired it)."""
    try:
        return repo.read_manifest(store, step)
    except repo.UnreadableManifest as exc:
        return exc
    except NoCheckpointError:
        return None


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    rows: list[tuple[int, Manifest | repo.UnreadableManifest]] = []
    for step in repo.committed_steps(store):
        read = _read(store, step)
        if read is not None:
            rows.append((step, read))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "step": m.step,
                        "mode": m.mode,
                        "base_step": m.base_step,
                        "world_size": m.world_size,
                        "logical_bytes": m.logical_bytes,
                        "uploaded_bytes": m.uploaded_bytes,
                        "created": m.created,
                    }
                    if isinstance(m, Manifest)
                    else {"step": s, "unreadable": m.reason}
                    for s, m in rows
                ]
            )
        )
        return 0
    if not rows:
        print("no committed checkpoints")
        return 0
    print(
        f"{'STEP':>10}  {'MODE':<12} {'BASE':>10}  {'WORLD':>5}  "
        f"{'SIZE':>10}  {'UPLOADED':>10}  AGE"
    )
    for s, m in rows:
        if not isinstance(m, Manifest):
            print(f"{s:>10}  unreadable: {m.reason}")
            continue
        print(
            f"{m.step:>10}  {m.mode:<12} {m.base_step:>10}  {m.world_size:>5}  "
            f"{_size(m.logical_bytes):>10}  {_size(m.uploaded_bytes):>10}  {_age(m.created)}"
        )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        m = _manifest(store, args.step)
    except repo.UnreadableManifest as exc:
        print(f"step {exc.step}: unreadable: {exc.reason}")
        return 1
    if args.json:
        print(m.to_bytes().decode())
        return 0
    created = datetime.datetime.fromtimestamp(m.created, datetime.UTC).isoformat(timespec="seconds")
    print(f"step {m.step}  mode {m.mode}  base {m.base_step}  parent {m.parent_step}")
    print(f"world size {m.world_size}  created {created}  versions {m.versions}")
    print(
        f"bytes: logical {_size(m.logical_bytes)}, uploaded {_size(m.uploaded_bytes)}, "
        f"deduplicated {_size(m.deduplicated_bytes)}"
    )
    print(f"timings: {', '.join(f'{k} {v:.3f}s' for k, v in sorted(m.timings.items()))}")
    # by codec, each stored object once (a chunk named twice is stored once)
    try:
        chunks = {(c.id, c.codec): c for f in m.files.values() for c in f.chunks}
    except CheckpointError as exc:  # a rank manifest (version 3) is missing or corrupt
        print(f"stored: unreadable: {exc}")
        return 1
    codecs: dict[str, list[int]] = {}
    for c in chunks.values():
        count = codecs.setdefault(c.codec, [0, 0, 0])
        count[0], count[1], count[2] = count[0] + 1, count[1] + c.size, count[2] + c.stored_size
    print(
        "stored: "
        + ", ".join(
            f"{codec} {n} chunks {_size(raw)} as {_size(stored)}"
            + (f" ({raw / stored:.2f}x)" if stored and codec != "none" else "")
            for codec, (n, raw, stored) in sorted(codecs.items())
        )
    )
    if m.ranks:  # version 3: what the manifest itself says; the chunk lists stay unread
        print(f"format version 3: {len(m.ranks)} rank manifests (ranks/)")
        for ref in m.ranks:
            for name, size in sorted(ref.files.items()):
                print(f"  {name:<20} {_size(size):>10}  rank {ref.rank}  {ref.key}")
        return 0
    for name, f in sorted(m.files.items()):
        stored = sum(c.stored_size for c in f.chunks)
        print(f"  {name:<20} {_size(f.size):>10}  {len(f.chunks)} chunks, {_size(stored)} stored")
    return 0


def _trust_pickled_values(args: argparse.Namespace) -> bool:
    """--trust-pickled-values, or CTJ_TRUST_PICKLED_VALUES=1 (as the trainer reads it)."""
    env = os.environ.get("CTJ_TRUST_PICKLED_VALUES", "").strip().lower()
    return bool(args.trust_pickled_values) or env in ("1", "true", "yes", "on")


def cmd_verify(args: argparse.Namespace) -> int:
    # torch (for the allow-list and weights_only checks): only for the commands that need it
    from .load.checks import read_manifest
    from .load.verify import verify

    store = _store(args)
    listed = args.all or args.step is None
    if listed:
        steps = repo.committed_steps(store)
        if not steps:
            raise NoCheckpointError("no committed checkpoint at this location")
        steps = steps if args.all else steps[-1:]
    else:
        steps = [args.step]
    trust = _trust_pickled_values(args)
    bad = 0
    for step in steps:
        read = _read(store, step)  # parsed only: unreadable is told apart from unsafe
        if read is None and listed:
            print(f"step {step}: gone (retired since it was listed)")
            continue
        if isinstance(read, repo.UnreadableManifest):
            bad += 1
            print(f"step {step}: unreadable: {read.reason}")
            continue
        try:
            m = read_manifest(store, step)
        except UnsafeCheckpointError as exc:
            bad += 1
            print(f"step {step}: UNSAFE: {exc.chunk_id} {exc.reason}")
            continue
        with _progress(m.logical_bytes, f"verify {step}") as update:
            problems = verify(store, m, progress=update, trust_pickled_values=trust)
        if problems:
            bad += 1
            for p in problems:
                if isinstance(p, UnsafeCheckpointError):
                    print(f"step {step}: UNSAFE: {p.chunk_id} {p.reason}")
                elif isinstance(p, CorruptManifestError):
                    print(f"step {step}: CORRUPT: {p.chunk_id} {p.reason}")
                else:
                    print(f"step {step}: CORRUPT: {p.reason}: chunk {p.chunk_id}")
        else:
            print(f"step {step}: ok ({_size(m.logical_bytes)} verified)")
    return 1 if bad else 0


def cmd_gc(args: argparse.Namespace) -> int:
    report = repo.collect_garbage(_store(args), grace_s=args.grace, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{verb} {report.deleted_chunks} chunks ({_size(report.deleted_bytes)}) and "
        f"{report.deleted_parts} stale parts, {report.deleted_rank_manifests} rank manifests; "
        f"{report.kept_chunks} chunks in use or in grace"
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = _store(args)
    repo.remove(store, args.steps)
    print(
        f"removed checkpoint(s) {', '.join(map(str, args.steps))}; "
        "run `ctj checkpoints gc` to free their chunks"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    # torch: only for this command
    from .load.export import check_new_file, empty_directory, export_dcp, export_torch_save

    if args.torch_save:  # refused before any work, as is a directory that is not empty
        check_new_file(args.torch_save)
    store = _store(args)
    m = _manifest(store, args.step)
    empty_directory(args.out_dir)
    trust = _trust_pickled_values(args)
    with _progress(m.logical_bytes, f"export {m.step}") as update:
        out = export_dcp(store, m, args.out_dir, progress=update, trust_pickled_values=trust)
    print(
        f"exported step {m.step} to {out} (plain DCP: torch.distributed.checkpoint.load reads it)"
    )
    if args.torch_save:
        export_torch_save(out, args.torch_save)
        print(f"wrote {args.torch_save} (torch.save of the full state)")
    return 0


def cmd_sidecar(args: argparse.Namespace) -> int:
    from . import sidecar
    from .config import CheckpointConfig
    from .heartbeat import HeartbeatSettings

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {k: v for k, v in (("uri", args.uri), ("staging_dir", args.staging_dir)) if v}
    config = CheckpointConfig.from_env(**overrides)
    port = args.metrics_port if args.metrics_port is not None else config.metrics_port
    grace = args.grace if args.grace is not None else config.shutdown_grace_s
    host = args.metrics_host or os.environ.get("CTJ_METRICS_HOST") or "0.0.0.0"
    beat = HeartbeatSettings.from_env()  # CTJ_HEARTBEAT_LEASE unset: no heartbeat
    return sidecar.run(config, metrics_port=port, grace_s=grace, metrics_host=host, heartbeat=beat)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctj", description="ctj: fault-tolerant PyTorch training")
    top = parser.add_subparsers(dest="command", required=True)
    sc = top.add_parser(
        "sidecar",
        help="persist what the trainer stages (runs beside it; settings from CTJ_* env; "
        "CTJ_HEARTBEAT_LEASE: renew that Lease, see trainer_sidecar/heartbeat.py)",
    )
    sc.add_argument("--uri", help="checkpoint location (default: CTJ_CHECKPOINT_URI)")
    sc.add_argument("--staging-dir", help="staging root shared with the trainer (CTJ_STAGING_DIR)")
    sc.add_argument(
        "--metrics-port",
        type=int,
        help="serve /metrics, /healthz, /readyz (default: CTJ_METRICS_PORT; 0 = any)",
    )
    sc.add_argument(
        "--metrics-host", help="address to serve on (default: CTJ_METRICS_HOST, the pod IP, or all)"
    )
    sc.add_argument(
        "--grace",
        type=float,
        help="seconds to finish staged work after SIGTERM (CTJ_SHUTDOWN_GRACE_S, 25)",
    )
    sc.set_defaults(fn=cmd_sidecar)
    ck = top.add_parser("checkpoints", help="inspect and manage a job's checkpoints")
    sub = ck.add_subparsers(dest="action", required=True)

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help_: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("uri", help="s3://bucket/prefix or file:///dir")
        p.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
        p.set_defaults(fn=fn)
        return p

    p = add("ls", cmd_ls, "list committed checkpoints")
    p.add_argument("--json", action="store_true")
    p = add("show", cmd_show, "show one checkpoint's manifest (default: the latest)")
    p.add_argument("--step", type=int)
    p.add_argument("--json", action="store_true")
    p = add(
        "verify",
        cmd_verify,
        "read every chunk and check its hash, and that it would load safely (default: the latest)",
    )
    p.add_argument("--step", type=int)
    p.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    p.add_argument(
        "--trust-pickled-values",
        action="store_true",
        help="non-tensor values may be any pickle (default: weights_only rules; "
        "CTJ_TRUST_PICKLED_VALUES=1). Only for checkpoints nobody else can write",
    )
    p = add("gc", cmd_gc, "delete chunks no checkpoint references")
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        help="keep unreferenced chunks younger than this many seconds (default 3600)",
    )
    p.add_argument("--dry-run", action="store_true")
    p = add("rm", cmd_rm, "remove checkpoints (their chunks go at the next gc)")
    p.add_argument("steps", type=int, nargs="+")
    p = add("export", cmd_export, "write a plain DCP directory stock torch can load")
    p.add_argument("out_dir")
    p.add_argument("--step", type=int)
    p.add_argument("--torch-save", metavar="FILE", help="also write one torch.save file")
    p.add_argument(
        "--trust-pickled-values",
        action="store_true",
        help="non-tensor values may be any pickle (default: weights_only rules; "
        "CTJ_TRUST_PICKLED_VALUES=1). Only for checkpoints nobody else can write",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CheckpointError as exc:
        print(f"ctj: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ctj: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
