"""The node agent's pure parts and its store: eviction across jobs, the token check, and
which job directories the collector removes."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from pathlib import Path

import pytest
from ctj_contract.tokens import job_token

from trainer_sidecar.agent.gc import Collector, Listing, stale_jobs
from trainer_sidecar.agent.server import serve_agent
from trainer_sidecar.agent.store import JobKey, NodeStore, plan_evictions
from trainer_sidecar.store.agent_client import (
    FIRST_PAUSE_S,
    PAUSE_S,
    AgentCache,
    job_path,
    pause_after,
)
from trainer_sidecar.store.peer_limits import PeerClientLimits

KEY = b"k" * 32
A = JobKey("ml", "train", "uid-a")
B = JobKey("ml", "other", "uid-b")


def cid(n: int) -> str:
    return f"{n:064x}"


def put(store: NodeStore, job: JobKey, chunk_id: str, data: bytes) -> bool:
    with store.writing(job, chunk_id, len(data)) as f:
        if f is None:
            return False
        f.write(data)
    return True


@pytest.mark.parametrize(
    ("held", "reserved", "incoming", "expected"),
    [
        (300, 0, 100, []),  # fits: nothing goes
        (1000, 0, 100, ["a"]),  # down to 90% of the bound less the write: oldest first
        (1000, 500, 100, ["a", "b", "c"]),  # writes in flight count against it
        (0, 950, 100, None),  # the writes in flight alone take the bound: refused
    ],
)
def test_eviction_takes_the_least_recently_used_until_the_write_fits(
    held: int, reserved: int, incoming: int, expected: list[str] | None
) -> None:
    lru = [(k, 250) for k in "abcd"]
    assert plan_evictions(lru, held, reserved, incoming, 1000) == expected


def test_the_bound_is_per_node_across_jobs_and_the_least_recently_used_go(tmp_path: Path) -> None:
    store = NodeStore(tmp_path, 1000)
    assert put(store, A, cid(1), bytes(300))
    assert put(store, B, cid(2), bytes(300))
    assert store.held(A, [cid(1)], touch=True) == [cid(1)]  # A's is used again: B's is older
    assert put(store, B, cid(3), bytes(300))
    assert put(store, A, cid(4), bytes(300))  # 1200 > 1000: the oldest, B's first, goes
    assert store.held(B, [cid(2)]) == []
    assert store.held(A, [cid(1), cid(4)]) == [cid(1), cid(4)]
    assert store.bytes_held <= 1000
    assert not (store.dir(B) / cid(2)[:2] / cid(2)).exists()
    # a fresh process finds the same entries (the index is rebuilt from the disk)
    again = NodeStore(tmp_path, 1000)
    assert again.bytes_held == store.bytes_held


def test_a_chunk_being_written_is_never_evicted_and_a_full_bound_refuses(tmp_path: Path) -> None:
    store = NodeStore(tmp_path, 1000)
    with store.writing(A, cid(1), 700) as first:
        assert first is not None
        first.write(bytes(700))
        assert not put(store, B, cid(2), bytes(400))  # 700 in flight + 400 > 1000: refused
        assert put(store, B, cid(3), bytes(200))
    assert sorted(store.held(A, [cid(1)]) + store.held(B, [cid(3)])) == [cid(1), cid(3)]
    with store.writing(A, cid(5), 10) as short:  # a body that ends early leaves nothing
        assert short is not None
        short.write(b"abc")
    assert store.held(A, [cid(5)]) == []
    assert not list((store.dir(A) / ".tmp").iterdir())


T0 = 1000.0


@pytest.mark.parametrize(
    ("job", "created", "listing", "removed"),
    [
        (A, T0 - 60, Listing(frozenset({"uid-a"}), T0), False),  # live
        (A, T0 - 60, Listing(frozenset(), T0), True),  # gone, made before the list
        (A, T0 - 0.5, Listing(frozenset(), T0), False),  # maybe made after the list saw
        (A, T0 + 5, Listing(frozenset(), T0), False),  # made after the list began
        (A, T0 - 60, Listing(frozenset(), T0, frozenset({"other-ns"})), False),  # not seen
        (A, T0 - 60, Listing(frozenset(), T0, frozenset({"ml"})), True),
        # same name, another uid: a new job of the name does not keep the old one's data
        (A, T0 - 60, Listing(frozenset({"uid-new"}), T0), True),
    ],
)
def test_the_collector_removes_only_directories_no_live_job_owns(
    job: JobKey, created: float, listing: Listing, removed: bool
) -> None:
    assert stale_jobs([(job, created)], listing) == ([job] if removed else [])


class Lister:
    def __init__(self) -> None:
        self.uids: set[str] | None = set()

    def list(self) -> Listing:
        if self.uids is None:
            raise OSError("the API server is down")
        return Listing(frozenset(self.uids), 1e12)  # every directory is older than this


def test_a_collection_removes_a_deleted_jobs_directory_and_a_failed_list_removes_none(
    tmp_path: Path,
) -> None:
    store = NodeStore(tmp_path, 1 << 20)
    put(store, A, cid(1), b"a" * 10)
    put(store, B, cid(2), b"b" * 10)
    lister = Lister()
    collector = Collector(store, lister, period_s=1)
    lister.uids = None
    assert collector.collect() == [] and len(store.jobs()) == 2
    lister.uids = {"uid-a"}
    assert collector.collect() == [B]
    assert store.jobs() == [A] and not (tmp_path / "ml" / "other").exists()
    assert store.bytes_held == 10


def test_the_agent_serves_a_job_only_with_its_own_token(tmp_path: Path) -> None:
    store = NodeStore(tmp_path, 1 << 20)
    server = serve_agent(store, key=KEY, host="127.0.0.1")
    agent = f"127.0.0.1:{server.server_address[1]}"
    limits = PeerClientLimits(restore_budget_s=1)
    try:
        token = job_token(KEY, *A.relative.split("/"))
        mine = AgentCache(agent, job_path(A.namespace, A.name, A.uid), token=token, limits=limits)
        mine.keep(cid(1), b"0123456789")
        assert mine.held([cid(1), cid(2)]) == {cid(1)}
        assert mine.read(cid(1), 2, 5) == b"234"
        # B's token opens B's path only; a forged one nothing; nothing is read before the check
        other = job_token(KEY, *B.relative.split("/"))
        for path, bearer in [
            (job_path(A.namespace, A.name, A.uid), other),
            (job_path(A.namespace, A.name, A.uid), "x" * 64),
            (job_path(A.namespace, A.name, "uid-new"), token),  # a new job of the same name
        ]:
            conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
            conn.request(
                "GET", f"{path}/chunks/{cid(1)}", headers={"Authorization": f"Bearer {bearer}"}
            )
            assert conn.getresponse().status == 401
            conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
        conn.request("GET", f"/v1/jobs/../x/y/chunks/{cid(1)}")
        assert conn.getresponse().status == 404
        conn.close()
        mine.discard(cid(1))
        assert mine.held([cid(1)]) == set()
    finally:
        server.shutdown()
        server.server_close()


def test_an_agent_that_is_down_is_a_miss_never_an_error(tmp_path: Path) -> None:
    cache = AgentCache("127.0.0.1:9", job_path("ml", "train", "u"), token="t" * 64)
    cache.keep(cid(1), b"x")  # nothing listens on port 9: logged, paused, no exception
    assert cache.held([cid(1)]) == set() and cache.read(cid(1), 0, 1) is None


def test_failures_in_a_row_leave_the_agent_alone_longer_up_to_the_most() -> None:
    assert [pause_after(n) for n in (1, 2, 3, 5, 6, 1000)] == [1.0, 2.0, 4.0, 16.0, 30.0, 30.0]


def test_an_agent_that_was_unreachable_at_first_is_used_within_seconds(tmp_path: Path) -> None:
    # a new pod's first requests can fail (a policy enforcer that has not yet seen its
    # address, an agent restarting): the save after the first pause reaches the agent
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = job_token(KEY, *A.relative.split("/"))
    cache = AgentCache(f"127.0.0.1:{port}", job_path(A.namespace, A.name, A.uid), token=token)
    cache.keep(cid(1), b"first")  # refused: a miss, and the agent is left alone a while
    failed_at = time.monotonic()
    server = serve_agent(NodeStore(tmp_path, 1 << 20), key=KEY, host="127.0.0.1", port=port)
    try:
        assert cache.held([cid(1)]) == set()  # within the pause: not asked
        while not cache.held([cid(1)]) and time.monotonic() - failed_at < PAUSE_S:
            cache.keep(cid(1), b"first")  # each save gives the agent its chunks
            time.sleep(0.05)  # the pace of saves, not a wait for a condition
        took = time.monotonic() - failed_at
        assert cache.held([cid(1)]) == {cid(1)} and took < 3 * FIRST_PAUSE_S, took
    finally:
        server.shutdown()
        server.server_close()


def test_the_agent_imports_neither_torch_nor_kopf() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import trainer_sidecar.agent.main, trainer_sidecar.store.agent_client; "
        "bad = {'torch', 'kopf'} & set(sys.modules); print(json.dumps(sorted(bad)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code],
        capture_output=True, text=True, check=True, env=dict(os.environ),
    )  # fmt: skip
    assert json.loads(out.stdout) == []


def test_the_mount_table_is_read_with_its_escapes(tmp_path: Path) -> None:
    """A bind mount from the same filesystem keeps its parent's device, so the mounter
    reads mountinfo; its fifth field writes a space as \\040."""
    from trainer_sidecar.agent.csi import mount_points

    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "90 22 8:1 /cache/ml/demo/u /var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/v\\040x/mount"
        " ro,nosuid,nodev,noexec shared:1 - ext4 /dev/sda1 rw\n"
    )
    assert mount_points(str(table)) == {
        "/", "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/v x/mount"
    }


@pytest.mark.parametrize(
    "args, said",
    [
        (["--owner", "nobody", "--node-id", "n1"], "--owner 'nobody': use uid:gid"),
        (["--owner", "1:1", "--node-id", ""], "no node name: set --node-id"),
    ],
)
def test_the_mounter_refuses_bad_settings_naming_the_fix(
    args: list[str], said: str, caplog: pytest.LogCaptureFixture
) -> None:
    import argparse

    from trainer_sidecar.agent.main import add_mounter_arguments, run_mounter

    parser = argparse.ArgumentParser()
    add_mounter_arguments(parser)
    assert run_mounter(parser.parse_args(args)) == 2
    assert said in caplog.text
