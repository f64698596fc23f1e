"""The staging slot protocol between a trainer and its persister (no torch here).

A save copies a rank's state once, into a slot: files in a memory-backed
directory (/dev/shm locally, an emptyDir with medium Memory in a pod). The
trainer writes the slot's data, then ``ready.json`` (atomically) last; the slot
is busy until the persister is done with it and removes ``ready.json``. A
trainer killed mid-copy leaves no ``ready.json``: the slot is simply free.

    <root>/state.json                          latest commit, written by rank 0's persister
    <root>/rank-<r>.lock                       held (flock) by the one trainer staging rank r
    <root>/rank-<r>/slot-<k>/__<r>_0.distcp    raw tensor bytes (kept mapped, save/staging.py)
    <root>/rank-<r>/slot-<k>/__<r>_1.distcp    non-tensor values (DCP's byte streams)
    <root>/rank-<r>/slot-<k>/.metadata         DCP metadata (coordinator's slot only)
    <root>/rank-<r>/slot-<k>/ready.json        the staged checkpoint's description

The root is private (mode 0700, owned by us, checked): whoever can write a slot
decides what gets committed. So are the directories above it, as ssh's StrictModes
checks a home directory (``check_parents``): each is ours or root's, and none lets
another user rename our root away and put one of theirs in its place. A slot's
``ready.json`` names plain files of that slot alone. The sidecar (sidecar.py) reads
slots through this module alone, so it never imports torch.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import json
import logging
import math
import os
import shutil
import stat
import time
from pathlib import Path
from typing import NamedTuple

from ..errors import CheckpointError
from ..format.chunking import Span
from ..format.manifest import SaveIdentity
from ..format.policy import Committed, SavePlan

READY = "ready.json"
STATE = "state.json"

log = logging.getLogger("ctj.slots")


class UnsafeSlot(ValueError):
    """A ``ready.json`` naming a file outside its slot: never persisted."""


def plain_name(name: str) -> bool:
    """One path component of printable characters: no separator, not ``.`` or ``..``."""
    return (
        name not in ("", ".", "..")
        and not any(c in name for c in ("/", "\\", "\0"))
        and name.isprintable()
    )


@dataclasses.dataclass(frozen=True, slots=True)
class StagedCheckpoint:
    """ready.json: everything the persister needs, nothing the trainer must still do."""

    step: int
    rank: int
    world_size: int
    plan: SavePlan  # rank 0's decision, the save's identity included
    files: tuple[tuple[str, tuple[Span, ...]], ...]  # (file name in slot, items: extent, dtype)
    staged_at: float  # wall clock, for the end-to-end latency metric
    stage_seconds: float

    def __post_init__(self) -> None:
        for name, _ in self.files:  # the persister opens <slot>/<name>: nothing else
            if not plain_name(name):
                raise UnsafeSlot(f"staged file {name!r} is not a plain file name inside the slot")

    @property
    def save(self) -> SaveIdentity:
        return self.plan.save

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "rank": self.rank,
                "world_size": self.world_size,
                "plan": self.plan.to_json(),
                "files": [[n, [_item(s) for s in items]] for n, items in self.files],
                "staged_at": self.staged_at,
                "stage_seconds": self.stage_seconds,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> StagedCheckpoint:
        raw = json.loads(text)
        return cls(
            step=int(raw["step"]),
            rank=int(raw["rank"]),
            world_size=int(raw["world_size"]),
            plan=SavePlan.from_json(raw["plan"]),
            files=tuple(
                (str(n), tuple(Span(int(i[0]), int(i[1]), *map(str, i[2:3])) for i in items))
                for n, items in raw["files"]
            ),
            staged_at=float(raw["staged_at"]),
            stage_seconds=float(raw["stage_seconds"]),
        )


def _item(span: Span) -> list[int | str]:
    """An item extent in ready.json: [offset, length] or [offset, length, dtype] (a slot
    staged by a ctj that recorded no dtypes reads as unknown dtypes: plain codecs)."""
    return [span.offset, span.length, span.dtype] if span.dtype else [span.offset, span.length]


def parent_problem(mode: int, owner: int, *, euid: int, pod_volume: bool) -> str | None:
    """Why a directory above the staging root lets another user replace it (None: it
    does not). Ours or root's, and writable by nobody else, unless sticky (/tmp,
    /dev/shm: others add names there, but only we rename or remove ours) or a pod's own
    volume (a kubelet mounts an emptyDir root-owned 0777 for the pod's containers alone).
    """
    if owner not in (euid, 0):
        return f"belongs to uid {owner}, not to this process (uid {euid}) or root"
    if mode & 0o022 and not mode & stat.S_ISVTX and not (pod_volume and owner == 0):
        return f"is writable by other users (mode {stat.S_IMODE(mode):04o}, not sticky)"
    return None


def check_parents(root: Path) -> None:
    """Every existing directory above ``root``, links resolved, passes ``parent_problem``;
    else a CheckpointError naming the directory and the fix."""
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    here = Path(os.path.realpath(root.parent))
    for directory in (here, *here.parents):
        try:
            info = os.stat(directory)
        except FileNotFoundError:
            continue  # made below, by us
        problem = parent_problem(
            info.st_mode,
            info.st_uid,
            euid=os.geteuid(),
            pod_volume=in_pod and os.path.ismount(directory),
        )
        if problem:
            fix = (
                "remove it if it is not yours"
                if problem.startswith("belongs")
                else f"chmod go-w {directory} (or chmod +t, as /tmp is)"
            )
            raise CheckpointError(
                f"staging directory {root} is unsafe: {directory} {problem}, so another "
                f"user could put a staging directory of theirs in its place: {fix}, or set "
                "CTJ_STAGING_DIR to a directory only you can write"
            )


def _make_parents(path: Path) -> None:
    """``mkdir -p`` whose new directories nobody else can write: 0755 (less the umask),
    where ``mkdir -p`` gives a umask of 002 group-writable ones."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o755)
        except FileExistsError:
            pass  # made meanwhile: check_parents judges it


def prepare_root(root: Path) -> Path:
    """Create the job's staging directory 0700, or check that an existing one is ours.

    A directory someone else owns (or can write) could feed our persister a slot
    of their making, or read our state: refuse it with the fix. The directories above
    it are checked too (``check_parents``), before anything is made in them.
    """
    check_parents(root)
    _make_parents(root.parent)
    check_parents(root)  # what was made meanwhile by someone else, too
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(
            f"staging path {root} is not a directory: remove it or set CTJ_STAGING_DIR"
        )
    if info.st_uid != os.geteuid():
        raise CheckpointError(
            f"staging directory {root} belongs to uid {info.st_uid}, not to this process "
            f"(uid {os.geteuid()}): use a directory of your own (CTJ_STAGING_DIR), and run the "
            "trainer and its sidecar as the same user"
        )
    if info.st_mode & 0o077:
        os.chmod(root, 0o700)
    return root


class RankLock:
    """An exclusive lock on (staging root, rank) for the life of one Checkpointer.

    Two trainers staging the same rank into the same root would overwrite each
    other's slots; the second one gets a CheckpointError instead. The kernel drops
    the lock when its process dies (kill -9 included), so a restart never waits.
    """

    def __init__(self, root: Path, rank: int) -> None:
        self.path = root / f"rank-{rank}.lock"
        self._fd: int | None = None
        self.rank = rank

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise CheckpointError(
                f"rank {self.rank} is already staging in {self.path.parent} (pid {holder}): "
                "two processes may not share a rank's staging; check RANK, close() the other "
                "Checkpointer, or give each job its own CTJ_STAGING_DIR"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank}"


def slot_dirs(root: Path, rank: int, count: int) -> list[Path]:
    return [rank_dir(root, rank) / f"slot-{k}" for k in range(count)]


def free_slot(root: Path, rank: int, count: int) -> Path | None:
    for slot in slot_dirs(root, rank, count):
        if not (slot / READY).exists():
            return slot
    return None


def wait_free_slot(root: Path, rank: int, count: int, timeout_s: float) -> Path | None:
    """Poll (1 ms growing to 50 ms) until a slot frees up or the timeout passes.

    The persister that frees it may be another process (the sidecar): a poll of
    the slot files is the one cross-process signal both modes share.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        slot = free_slot(root, rank, count)
        if slot is not None or time.monotonic() >= deadline:
            return slot
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def remove_rank_dir(root: Path, rank: int) -> None:
    """Delete a rank's slots (their mappings must be closed first: save/staging.py)."""
    shutil.rmtree(rank_dir(root, rank), ignore_errors=True)


def mark_ready(slot: Path, staged: StagedCheckpoint) -> None:
    tmp = slot / (READY + ".tmp")
    tmp.write_text(staged.to_json())
    os.replace(tmp, slot / READY)


def release(slot: Path) -> None:
    (slot / READY).unlink(missing_ok=True)


def pending(root: Path, rank: int | None = None) -> list[tuple[Path, StagedCheckpoint]]:
    """Staged, not yet persisted checkpoints under root (of one rank, or all), oldest first."""
    found = []
    for ready in _ready_files(root, rank):
        try:
            found.append((ready.parent, StagedCheckpoint.from_json(ready.read_text())))
        except UnsafeSlot as exc:
            if ready not in _refused:  # said once, not at every poll
                _refused.add(ready)
                log.error("%s refused, nothing in it persisted: %s", ready, exc)
            continue
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError, TypeError):
            continue  # released meanwhile, or not a slot this version wrote
    return sorted(found, key=lambda p: (p[1].step, p[1].rank))


_refused: set[Path] = set()  # ready.json files refused (and said so) by pending()


def _ready_files(root: Path, rank: int | None) -> list[Path]:
    """``<root>/rank-<r>/slot-*/ready.json``, tolerating directories that go meanwhile: a
    trainer's close() removes its rank's directory while its sidecar polls (pathlib's glob
    raises FileNotFoundError on a directory removed between listing and reading it)."""

    def listing(path: Path, prefix: str) -> list[Path]:
        try:
            with os.scandir(path) as entries:
                return [Path(e.path) for e in entries if e.name.startswith(prefix)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    ranks = [root / f"rank-{rank}"] if rank is not None else listing(root, "rank-")
    return [slot / READY for r in ranks for slot in listing(r, "slot-")]


def write_state(root: Path, committed: Committed, uri: str) -> None:
    tmp = root / (STATE + ".tmp")
    tmp.write_text(json.dumps({"uri": uri, **dataclasses.asdict(committed)}))
    os.replace(tmp, root / STATE)


def read_state(root: Path, uri: str) -> Committed | None:
    try:
        raw = json.loads((root / STATE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if raw.pop("uri", None) != uri:
        return None
    return Committed(**raw)


# -- the checkpoint request (the sidecar writes it from its Lease; the Checkpointer reads it)

REQUEST_FILE = "checkpoint-request"


def request_path(root: Path) -> Path:
    return Path(root) / REQUEST_FILE


def write_request(root: Path, request_id: str) -> Path:
    """Write the request id to ``<root>/checkpoint-request`` atomically (tmp + rename)."""
    path = request_path(root)
    tmp = path.with_name(f".{REQUEST_FILE}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(request_id)
    os.replace(tmp, path)
    return path


def read_request(root: Path) -> str | None:
    """The checkpoint request id in the staging root, or None."""
    try:
        text = request_path(root).read_text(errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text or None


# -- observations the trainer relays to its sidecar ------------------------------------

OBSERVED_DIR = "observed"
OBSERVATIONS = ("stall", "restore", "failure", "skipped")
MAX_RANKS = 1 << 20  # a relayed rank becomes a label value: bounded, past any real job
_relayed = itertools.count()


def relay_observation(root: Path, rank: int, name: str, value: float, stage: str = "") -> None:
    """A metric observation the trainer made (in sidecar mode it serves no /metrics), for
    the sidecar to export: one small JSON file under ``<root>/observed/``, written
    atomically. Best effort: an observation lost is a sample missing, never an error."""
    folder = Path(root) / OBSERVED_DIR
    final = folder / f"{rank}-{time.time_ns()}-{next(_relayed)}.json"
    tmp = folder / f".{final.name}.tmp"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"name": name, "value": value, "stage": stage, "rank": rank}, f)
        os.replace(tmp, final)
    except OSError:
        pass


class Observation(NamedTuple):
    """One relayed observation, as ``CheckpointMetrics.apply`` takes it."""

    name: str
    value: float
    stage: str
    rank: int


def take_observations(root: Path) -> list[Observation]:
    """The relayed observations, each removed once read (the sidecar's
    loop); a file that is not one (unreadable, another shape) is dropped."""
    folder = Path(root) / OBSERVED_DIR
    try:
        names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: list[Observation] = []
    for name in names:
        path = folder / name
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            raw = None
        try:
            path.unlink()
        except OSError:
            pass
        if not isinstance(raw, dict) or raw.get("name") not in OBSERVATIONS:
            continue
        value, stage, rank = raw.get("value"), raw.get("stage", ""), raw.get("rank", 0)
        if not (isinstance(rank, int) and 0 <= rank < MAX_RANKS):
            continue  # a label value from the file: bounded, or none
        if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
            found.append(Observation(str(raw["name"]), float(value), str(stage), rank))
    return found
