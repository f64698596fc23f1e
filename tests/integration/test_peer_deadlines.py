"""The peer tier's deadlines in real restores (ranks as processes, the S3 server on
loopback, store/peer_limits.py): a flood of idle connections neither holds a real
sidecar's peer server nor the restore reading it, and peers that trickle or send too
much cost a restore no more than its documented bound over the same restore from S3."""

from __future__ import annotations

import json
import os
import re
import secrets
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ROOT
from tests.integration import workers
from tests.integration.ranks import run_ranks
from tests.integration.test_sidecar import wait_until
from tests.unit.test_peer_server import FakePeer
from trainer_sidecar import Checkpointer
from trainer_sidecar.load.tiers import restore_bound_s
from trainer_sidecar.store.chunk_cache import ChunkCache
from trainer_sidecar.store.peer_limits import PeerClientLimits
from trainer_sidecar.store.peers import PeerCaches, serve_cache

pytestmark = pytest.mark.integration

STEP = 5
CHUNK_SIZE = 1 << 18
CONFIG = {"block_size": 1 << 16, "chunk_size": CHUNK_SIZE}  # a rank reads blocks of its rows
# the restoring ranks' peer limits: short, so that the bound is small beside the noise
CLIENT_ENV = {
    "CTJ_PEER_REQUEST_DEADLINE_S": "1",
    "CTJ_PEER_LOCATE_DEADLINE_S": "1",
    "CTJ_PEER_RESTORE_BUDGET_S": "2",
}
CLIENT = PeerClientLimits.from_env(CLIENT_ENV)
# the flooded sidecar's: a small cap, a short header deadline
HEADER_DEADLINE_S = 2.0
MAX_CONNECTIONS = 16
FLOOD = 120
NOISE_S = 5.0  # these machines are shared: on top of every bound


def timed_load_on_nodes(args: dict[str, Any]) -> None:
    """A rank: restore through the tiers (workers.load_on_nodes' configuration), timing
    only ``Checkpointer.load``; rank 0 compares bitwise with the saved state."""
    model, opt = workers.build(args["kind"], seed=123)
    extra: dict[str, Any] = {"step": -1, "pos": -1}
    began = time.monotonic()
    result = Checkpointer(workers._node_config(args)).load(model=model, optimizer=opt, extra=extra)
    seconds = time.monotonic() - began
    assert result is not None and result.step == args["step"], result
    assert extra == {"step": args["step"], "pos": 7}, extra
    got = workers.full_state(model, opt)
    if dist.get_rank() == 0:
        workers.assert_bitwise_equal(got, torch.load(args["ref"], weights_only=True))
    out = {"seconds": seconds, "tiers": result.bytes_by_tier}
    Path(f"{args['out']}.{dist.get_rank()}.json").write_text(json.dumps(out))


@pytest.fixture
def token() -> str:
    return secrets.token_hex(16)


def _save(s3_uri: str, tmp_path: Path, nodes: list[Path]) -> None:
    args = {"kind": "big", "uri": s3_uri, "step": STEP, "ref": str(tmp_path / "ref.pt"),
            "caches": [str(n) for n in nodes], "config": CONFIG}  # fmt: skip
    run_ranks(len(nodes), "tests.integration.workers:save_on_nodes", args)


def _restore(
    s3_uri: str, tmp_path: Path, name: str, nodes: list[Path], peers: list[list[str]] | None,
    token: str, env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Rank r restores on node nodes[r] (its cache), reading peers[r]; what each timed."""
    args = {
        "kind": "big", "uri": s3_uri, "step": STEP, "ref": str(tmp_path / "ref.pt"),
        "out": str(tmp_path / name), "caches": [str(n) for n in nodes], "peers": peers,
        "token": token, "config": CONFIG,
    }  # fmt: skip
    run_ranks(len(nodes), f"{__name__}:timed_load_on_nodes", args, env=env, timeout=240)
    return [json.loads(Path(f"{tmp_path / name}.{r}.json").read_text()) for r in range(len(nodes))]


def test_peers_that_trickle_or_send_too_much_cost_a_restore_at_most_its_bound(
    s3_uri: str, tmp_path: Path, token: str
) -> None:
    """Two new nodes restore; their only peers claim to hold every chunk, then one sends
    its answers a byte every half second, the other a Content-Length of 64 MiB and as
    many bytes. Side by side with the same restore from S3 alone: both peers are misses,
    S3 serves everything, and the restore is no slower than the bound says."""
    _save(s3_uri, tmp_path, [tmp_path / "saved-0", tmp_path / "saved-1"])
    with FakePeer("trickle", every_s=0.5) as slow, FakePeer("oversize") as big:
        peers = [[slow.address, big.address]] * 2
        through = _restore(s3_uri, tmp_path, "peers", [tmp_path / "new-0", tmp_path / "new-1"],
                           peers, token, CLIENT_ENV)  # fmt: skip
        assert slow.gets and big.gets  # both were asked
        big.wait_answered(big.gets, within=10)  # its sends fail once the reader hangs up
        assert max(big.sent) < big.flood // 2  # not read: the kernel's buffers took some
    s3_only = _restore(s3_uri, tmp_path, "s3", [tmp_path / "s3-0", tmp_path / "s3-1"], None, token)
    assert all(r["tiers"].get("peer", 0) == 0 and r["tiers"].get("s3", 0) > 0 for r in through)
    slowest, baseline = max(r["seconds"] for r in through), max(r["seconds"] for r in s3_only)
    bound = restore_bound_s(CLIENT, CHUNK_SIZE)  # the ranks' peer misses, phase by phase
    print(f"restore: {slowest:.2f}s through the bad peers, {baseline:.2f}s from S3 alone; "
          f"bound {bound:.2f}s")  # fmt: skip
    assert slowest <= baseline + bound + NOISE_S, (slowest, baseline, bound)


class PeerSidecar:
    """`ctj sidecar` in its own process, serving a node's cache to the peers."""

    def __init__(self, uri: str, tmp_path: Path, cache: Path, token: str) -> None:
        self.log = tmp_path / "sidecar.log"
        env = dict(
            os.environ,
            CTJ_CACHE_DIR=str(cache),
            CTJ_CACHE_PORT="0",
            CTJ_CACHE_TOKEN=token,
            CTJ_PEER_HEADER_DEADLINE_S=str(HEADER_DEADLINE_S),
            CTJ_PEER_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer_sidecar", "sidecar", "--uri", uri,
             "--staging-dir", str(tmp_path / "staging"), "--metrics-port", "0", "--grace", "5"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(self.log, "a"),  # noqa: SIM115
        )  # fmt: skip
        serving = r"chunk cache to the job's peers on port (\d+)"
        wait_until(lambda: re.search(serving, self.text()), "the sidecar's peer server", 60)
        self.address = f"127.0.0.1:{re.findall(serving, self.text())[-1]}"

    def text(self) -> str:
        return self.log.read_text()

    def threads(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.findall(r"^Threads:\s+(\d+)", status, re.M)[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def sidecars() -> Iterator[list[PeerSidecar]]:
    started: list[PeerSidecar] = []
    yield started
    for s in started:
        s.stop()


class IdleFlood:
    """``count`` connections to ``address`` that never send a byte, each opened again once
    the server closes it, until ``stop``: how long each was held, and the most threads
    ``threads()`` counted while they were."""

    def __init__(self, address: str, count: int, threads: Any) -> None:
        host, port = address.split(":")
        self.target, self.count, self.threads = (host, int(port)), count, threads
        self.held: list[float] = []  # seconds each closed one was held by the server
        self.peak_threads = 0
        self.opened = 0
        self._stop = threading.Event()
        self._open: dict[socket.socket, float] = {}
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> IdleFlood:
        for _ in range(self.count):
            self._connect()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _connect(self) -> None:
        sock = socket.create_connection(self.target, timeout=5)
        sock.setblocking(False)
        self._open[sock] = time.monotonic()
        self._selector.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _closed(self, sock: socket.socket) -> bool:
        try:
            while sock.recv(65536):  # a 503 (refused), then the end
                pass
        except BlockingIOError:
            return False
        except OSError:
            pass
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            # rounds of half a second: each closed connection opened again once a round
            # (the refused ones close at once: no busy loop on them)
            round_ends = time.monotonic() + 0.5
            while (left := round_ends - time.monotonic()) > 0:
                self._reap(self._selector.select(left))
            self.peak_threads = max(self.peak_threads, self.threads())
            for _ in range(self.count - len(self._open)):
                self._connect()

    def _reap(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        for key, _ in ready:
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            if self._closed(sock):
                self.held.append(time.monotonic() - self._open.pop(sock))
                self._selector.unregister(sock)
                sock.close()

    def wait_all_closed(self, within: float) -> None:
        """Stop reopening; wait until the server has closed every one still open."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + within
        while self._open:
            left = deadline - time.monotonic()
            assert left > 0, f"{len(self._open)} idle connections still held after {within}s"
            self._reap(self._selector.select(left))


def test_an_idle_flood_neither_holds_a_sidecars_peer_server_nor_the_restore_reading_it(
    s3_uri: str, tmp_path: Path, token: str, sidecars: list[PeerSidecar]
) -> None:
    """Three ranks save on three nodes; node 2 is lost; two ranks restore on nodes 0 and 1,
    each reading the other's cache: node 0's from its real sidecar, flooded all along by
    120 connections that send nothing (no token needed). The restore completes, bitwise;
    the sidecar holds at most its cap of them, each no longer than its header deadline,
    with as many threads; and serves the peers again once the flood ends."""
    nodes = [tmp_path / f"node-{i}" for i in range(3)]
    _save(s3_uri, tmp_path, nodes)
    sidecar = PeerSidecar(s3_uri, tmp_path, nodes[0], token)
    sidecars.append(sidecar)
    other = serve_cache(ChunkCache(nodes[1], 1 << 30), token=token, host="127.0.0.1")
    try:
        baseline_threads = sidecar.threads()
        with IdleFlood(sidecar.address, FLOOD, sidecar.threads) as flood:
            peers = [[f"127.0.0.1:{other.server_address[1]}"], [sidecar.address]]
            _restore(s3_uri, tmp_path, "flooded", nodes[:2], peers, token)
            flood.wait_all_closed(HEADER_DEADLINE_S + NOISE_S)
    finally:
        other.shutdown()
        other.server_close()
    print(f"flood: {flood.opened} opened, held at most {max(flood.held):.2f}s; threads "
          f"{baseline_threads} before, at most {flood.peak_threads} during")  # fmt: skip
    assert flood.opened > FLOOD  # closed ones were opened again while the restore ran
    assert max(flood.held) <= HEADER_DEADLINE_S + NOISE_S, max(flood.held)
    assert flood.peak_threads <= baseline_threads + MAX_CONNECTIONS + 4, (
        flood.peak_threads, baseline_threads,
    )  # fmt: skip
    assert sidecar.proc.poll() is None, sidecar.text()[-3000:]
    # the flood gone, the sidecar serves its cache again
    held = ChunkCache(nodes[0], 1 << 30).entries()
    assert held
    client = PeerCaches([sidecar.address], token=token)
    client.locate([held[0].chunk_id])
    data = client.read(held[0].chunk_id, 0, held[0].size)
    assert data == ChunkCache(nodes[0], 1 << 30).read(held[0].chunk_id, 0, held[0].size)
