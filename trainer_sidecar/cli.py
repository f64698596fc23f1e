"""The ``ctj`` command: inspect and manage a job's checkpoints.

    ctj checkpoints ls|show|verify|gc|rm|export URI ...

A user mistake (bad URI, bad environment setting, missing bucket or directory, wrong
credentials, unknown step) prints one line, ``ctj: error: ...``, and exits 2; a corrupt
checkpoint found by ``verify`` exits 1. Long work shows a progress bar on a terminal.

Every command only inspects what is there: a ``file://`` directory that does not exist is
an error, never created. The first request to S3 is bounded (``S3Store.check_reachable``):
an endpoint that does not answer is reported within seconds, naming it and the bucket;
after that the store retries as patiently as the sidecar does. ``--json``: one JSON
document on stdout (README, "Managing checkpoints", lists its keys); on a mistake, nothing
on stdout.

One bad checkpoint never hides the others: a manifest that cannot be read is a row
``step N: unreadable: <reason>`` in ``ls``, ``show`` and ``verify``, which go on with
the rest (``verify`` then exits 1, ``show --step N`` of that one too).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from tqdm import tqdm

from .config import TRUST_PICKLED_ENV, env_flag
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    CorruptManifestError,
    NoCheckpointError,
    UnsafeCheckpointError,
)
from .format.manifest import Manifest
from .store import repository as repo
from .store.base import Location, ObjectStore
from .store.s3 import S3Settings, S3Store, endpoint_problem, open_store, shown_endpoint


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


def _s3_settings(endpoint_url: str | None) -> S3Settings:
    """S3's settings from the environment, each checked (S3Settings.from_env), and
    --endpoint-url, named as such where it is no endpoint."""
    if endpoint_url is not None:
        problem = endpoint_problem(endpoint_url)
        if problem is not None:
            raise CheckpointError(
                f"--endpoint-url {shown_endpoint(endpoint_url)!r} {problem}: "
                "use http(s)://host[:port], e.g. http://minio:9000"
            )
    return S3Settings.from_env(endpoint_url=endpoint_url)


def _store(args: argparse.Namespace) -> ObjectStore:
    """The store a command inspects: the URI parsed strictly first, then the settings; a
    ``file://`` directory must exist (nothing is created); an S3 endpoint must answer
    within seconds."""
    Location.parse(args.uri)
    store = open_store(args.uri, _s3_settings(args.endpoint_url), create=False)
    if isinstance(store, S3Store):
        store.check_reachable()
    return store


def _print_json(document: object) -> None:
    print(json.dumps(document))


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


def _ls_row(step: int, read: Manifest | repo.UnreadableManifest) -> dict[str, object]:
    """One row of ``ls --json``."""
    if not isinstance(read, Manifest):
        return {"step": step, "unreadable": read.reason}
    return {
        "step": read.step,
        "mode": read.mode,
        "base_step": read.base_step,
        "world_size": read.world_size,
        "logical_bytes": read.logical_bytes,
        "uploaded_bytes": read.uploaded_bytes,
        "created": read.created,
    }


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    rows: list[tuple[int, Manifest | repo.UnreadableManifest]] = []
    for step in repo.committed_steps(store):
        read = _read(store, step)
        if read is not None:
            rows.append((step, read))
    if args.json:
        _print_json([_ls_row(s, m) for s, m in rows])
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
        if args.json:
            _print_json({"step": exc.step, "unreadable": exc.reason})
        else:
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
    """--trust-pickled-values, or CTJ_TRUST_PICKLED_VALUES=1 (as the trainer reads it): any
    other value than a boolean is a mistake, not a silent "no"."""
    env = os.environ.get(TRUST_PICKLED_ENV, "").strip()
    return bool(args.trust_pickled_values) or env_flag(TRUST_PICKLED_ENV, env)


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a checkpoint, as ``verify`` reports it."""

    kind: str  # corrupt | unsafe | unreadable
    what: str  # the chunk, the rank manifest or the manifest it is about
    reason: str
    line: str  # as the text output words it, after "step N: "


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """``verify``'s finding for one checkpoint."""

    step: int
    status: str  # ok | corrupt | unsafe | unreadable | gone
    logical_bytes: int | None = None
    problems: tuple[Problem, ...] = ()

    def lines(self) -> list[str]:
        if self.status == "ok":
            return [f"step {self.step}: ok ({_size(self.logical_bytes or 0)} verified)"]
        if self.status == "gone":
            return [f"step {self.step}: gone (retired since it was listed)"]
        return [f"step {self.step}: {p.line}" for p in self.problems]

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "status": self.status,
            "logical_bytes": self.logical_bytes,
            "problems": [
                {"kind": p.kind, "what": p.what, "reason": p.reason} for p in self.problems
            ],
        }


def _problem(p: CorruptCheckpointError) -> Problem:
    if isinstance(p, UnsafeCheckpointError):
        return Problem("unsafe", p.chunk_id, p.reason, f"UNSAFE: {p.chunk_id} {p.reason}")
    if isinstance(p, CorruptManifestError):
        return Problem("corrupt", p.chunk_id, p.reason, f"CORRUPT: {p.chunk_id} {p.reason}")
    return Problem("corrupt", p.chunk_id, p.reason, f"CORRUPT: {p.reason}: chunk {p.chunk_id}")


def verdict(step: int, size: int | None, problems: Sequence[Problem]) -> Verdict:
    """ok, or the worst of the problems: unsafe before corrupt before unreadable."""
    kinds = {p.kind for p in problems}
    status = next((k for k in ("unsafe", "corrupt", "unreadable") if k in kinds), "ok")
    return Verdict(step, status, size, tuple(problems))


def _needs_torch(command: str) -> None:
    """verify and export read DCP metadata with torch, which the base package (and the
    sidecar image) leaves out: one line that names the fix, not an ImportError."""
    if importlib.util.find_spec("torch") is None:
        raise CheckpointError(
            f"ctj checkpoints {command} needs torch: pip install ctj[trainer] "
            "(or run it in the trainer image)"
        )


def cmd_verify(args: argparse.Namespace) -> int:
    # torch (for the allow-list and weights_only checks): only for the commands that need it
    _needs_torch("verify")
    from .load.checks import read_manifest
    from .load.verify import verify

    trust = _trust_pickled_values(args)  # a bad setting is told before any request
    store = _store(args)
    listed = args.all or args.step is None
    if listed:
        steps = repo.committed_steps(store)
        if not steps:
            raise NoCheckpointError("no committed checkpoint at this location")
        steps = steps if args.all else steps[-1:]
    else:
        steps = [args.step]
    verdicts: list[Verdict] = []
    for step in steps:
        read = _read(store, step)  # parsed only: unreadable is told apart from unsafe
        if read is None and listed:
            found = Verdict(step, "gone")
        elif isinstance(read, repo.UnreadableManifest):
            reason = read.reason
            found = verdict(
                step, None, [Problem("unreadable", "manifest", reason, f"unreadable: {reason}")]
            )
        else:
            try:
                m = read_manifest(store, step)
            except UnsafeCheckpointError as exc:
                found = verdict(step, None, [_problem(exc)])
            else:
                with _progress(m.logical_bytes, f"verify {step}") as update:
                    problems = verify(store, m, progress=update, trust_pickled_values=trust)
                found = verdict(step, m.logical_bytes, [_problem(p) for p in problems])
        verdicts.append(found)
        if not args.json:
            for line in found.lines():
                print(line)
    if args.json:
        _print_json([v.to_json() for v in verdicts])
    return 1 if any(v.status not in ("ok", "gone") for v in verdicts) else 0


def cmd_gc(args: argparse.Namespace) -> int:
    report = repo.collect_garbage(_store(args), grace_s=args.grace, dry_run=args.dry_run)
    if args.json:
        _print_json({"dry_run": args.dry_run, **dataclasses.asdict(report)})
        return 0
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
    if args.json:
        _print_json({"removed": args.steps})
        return 0
    print(
        f"removed checkpoint(s) {', '.join(map(str, args.steps))}; "
        "run `ctj checkpoints gc` to free their chunks"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    # torch: only for this command
    _needs_torch("export")
    from .load.export import check_new_file, empty_directory, export_dcp, export_torch_save

    trust = _trust_pickled_values(args)
    if args.torch_save:  # refused before any work, as is a directory that is not empty
        check_new_file(args.torch_save)
    store = _store(args)
    m = _manifest(store, args.step)
    empty_directory(args.out_dir)
    with _progress(m.logical_bytes, f"export {m.step}") as update:
        out = export_dcp(store, m, args.out_dir, progress=update, trust_pickled_values=trust)
    if not args.json:
        print(
            f"exported step {m.step} to {out} "
            "(plain DCP: torch.distributed.checkpoint.load reads it)"
        )
    if args.torch_save:
        export_torch_save(out, args.torch_save)
        if not args.json:
            print(f"wrote {args.torch_save} (torch.save of the full state)")
    if args.json:
        _print_json({"step": m.step, "out_dir": str(out), "torch_save": args.torch_save})
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
    beat = HeartbeatSettings.from_env()  # no job token (not a pod of ours): no heartbeat
    return sidecar.run(config, metrics_port=port, grace_s=grace, metrics_host=host, heartbeat=beat)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctj", description="ctj: fault-tolerant PyTorch training")
    top = parser.add_subparsers(dest="command", required=True)
    sc = top.add_parser(
        "sidecar",
        help="persist what the trainer stages (runs beside it; settings from CTJ_* env; "
        "answers the operator's heartbeat on the metrics port, see trainer_sidecar/heartbeat.py)",
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
    ag = top.add_parser(
        "agent",
        help="the node agent: every job's node cache on this node (a DaemonSet; "
        "trainer_sidecar/agent/)",
    )
    from .agent import main as agent_main  # stdlib and ctj_contract only

    agent_main.add_arguments(ag)
    ag.set_defaults(fn=agent_main.run)
    mo = top.add_parser(
        "agent-mounter",
        help="the node agent's CSI endpoint: mounts a job's node cache read-only into its "
        "pods (the DaemonSet's privileged container; trainer_sidecar/agent/csi.py)",
    )
    agent_main.add_mounter_arguments(mo)
    mo.set_defaults(fn=agent_main.run_mounter)
    ck = top.add_parser("checkpoints", help="inspect and manage a job's checkpoints")
    sub = ck.add_subparsers(dest="action", required=True)

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help_: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("uri", help="s3://bucket/prefix or file:///dir (which must exist)")
        p.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
        p.add_argument(
            "--json",
            action="store_true",
            help="print one JSON document on stdout (keys: README, Managing checkpoints)",
        )
        p.set_defaults(fn=fn)
        return p

    add("ls", cmd_ls, "list committed checkpoints")
    p = add("show", cmd_show, "show one checkpoint's manifest (default: the latest)")
    p.add_argument("--step", type=int)
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
