"""The node-local tier: a restore after a node loss reads the nodes' caches, then S3.

Each rank saves on its own "node" (a cache directory of its own); a node is
lost (its cache is gone); the next attempt loads through the tiers, with the
surviving nodes' caches served to it over HTTP, token-checked, by real peer
servers. Every load is bitwise equal, and S3 serves no more than the lost
node's share.
"""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks
from trainer_sidecar.format.manifest import Manifest, manifest_key
from trainer_sidecar.store.chunk_cache import ChunkCache
from trainer_sidecar.store.peers import PeerCaches, serve_cache
from trainer_sidecar.store.s3 import open_store

pytestmark = pytest.mark.integration

STEP = 5
PACK = 256 << 10  # format/chunking.DEFAULT_PACK_SIZE


@pytest.fixture
def token() -> str:
    return secrets.token_hex(16)


class Nodes:
    """Cache directories as nodes, and a peer server over each one still up."""

    def __init__(self, root: Path, count: int, token: str) -> None:
        self.dirs = [root / f"node-{i}" for i in range(count)]
        self.token = token
        self.servers: dict[int, object] = {}

    def lose(self, node: int) -> None:
        shutil.rmtree(self.dirs[node])

    def serve(self, nodes: list[int]) -> None:
        for n in nodes:
            cache = ChunkCache(self.dirs[n], 1 << 30)
            self.servers[n] = serve_cache(cache, token=self.token, host="127.0.0.1")

    def address(self, node: int) -> str:
        return f"127.0.0.1:{self.servers[node].server_address[1]}"  # type: ignore[attr-defined]

    def stop(self) -> None:
        for server in self.servers.values():
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]


@pytest.fixture
def nodes(tmp_path: Path, token: str) -> Iterator[Nodes]:
    made = Nodes(tmp_path / "nodes", 3, token)
    yield made
    made.stop()


def _bytes_by_tier(out: Path, world_size: int) -> list[dict[str, int]]:
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(world_size)]


def _share(s3_uri: str, rank: int) -> int:
    """Bytes of the files the given rank of the saving world wrote."""
    manifest = Manifest.from_bytes(open_store(s3_uri).get(manifest_key(STEP)))
    sizes = manifest.file_sizes()  # (names and sizes: no rank manifest read)
    return sum(size for name, size in sizes.items() if name.startswith(f"__{rank}_"))


def _args(s3_uri: str, tmp_path: Path, nodes: Nodes, placement: list[int]) -> dict[str, object]:
    """Rank r of the loading attempt runs on node placement[r]; its peers are the other
    nodes of the attempt that are up."""
    peers = [[nodes.address(n) for n in placement if n != own and n in nodes.servers]
             for own in placement]  # fmt: skip
    return {
        "kind": "big",
        "uri": s3_uri,
        "step": STEP,
        "ref": str(tmp_path / "ref.pt"),
        "out": str(tmp_path / "tiers"),
        "caches": [str(nodes.dirs[n]) for n in placement],
        "peers": peers,
        "token": nodes.token,
        # 64 KiB blocks: a rank reads only the blocks of its rows
        "config": {"block_size": 1 << 16, "chunk_size": 1 << 18},
    }


def test_after_a_node_loss_the_resharded_restore_reads_the_caches_and_s3_only_the_lost_share(
    s3_uri: str, tmp_path: Path, nodes: Nodes
) -> None:
    run_ranks(
        3,
        "tests.integration.workers:save_on_nodes",
        _args(s3_uri, tmp_path, nodes, [0, 1, 2]) | {"peers": None},
    )
    nodes.lose(2)
    nodes.serve([0, 1])
    outputs = run_ranks(
        2, "tests.integration.workers:load_on_nodes", _args(s3_uri, tmp_path, nodes, [0, 1])
    )
    assert "bitwise equal at world size 2" in outputs[0]
    tiers = _bytes_by_tier(tmp_path / "tiers", 2)
    s3 = sum(t.get("s3", 0) for t in tiers)
    # the lost node's chunks, and nothing else: each rank reads at most that share, and
    # both together little more (small items DCP saved once, e.g. the optimizer's step,
    # sit in packed chunks of the lost rank that every new rank reads a block of)
    share = _share(s3_uri, 2)
    assert all(t.get("s3", 0) <= share for t in tiers), (tiers, share)
    assert 0 < s3 <= share + PACK, (tiers, share)
    assert all(t.get("local", 0) > 0 for t in tiers), tiers
    assert tiers[1].get("peer", 0) > 0 or tiers[0].get("peer", 0) > 0, tiers


def test_a_new_node_reads_its_peers_and_a_damaged_cache_entry_is_refetched(
    s3_uri: str, tmp_path: Path, nodes: Nodes
) -> None:
    """Same world size, rank 1 rescheduled onto a new node (2): it has nothing locally and
    reads what it needs... which only the lost node 1 held; so that comes from S3. Node
    0's cache entries are damaged on disk first: rank 0 notices, drops them and refetches."""
    run_ranks(
        2,
        "tests.integration.workers:save_on_nodes",
        _args(s3_uri, tmp_path, nodes, [0, 1]) | {"peers": None},
    )
    nodes.lose(1)
    nodes.dirs[2].mkdir(parents=True)
    damaged = ChunkCache(nodes.dirs[0], 1 << 30).entries()
    assert damaged
    for entry in damaged:
        path = nodes.dirs[0] / entry.chunk_id[:2] / entry.chunk_id
        path.write_bytes(b"\x00" * entry.size)
    nodes.serve([0])
    outputs = run_ranks(
        2, "tests.integration.workers:load_on_nodes", _args(s3_uri, tmp_path, nodes, [0, 2])
    )
    assert "bitwise equal at world size 2" in outputs[0]
    tiers = _bytes_by_tier(tmp_path / "tiers", 2)
    assert tiers[0].get("local", 0) == 0 and tiers[0].get("s3", 0) > 0, tiers
    # the damaged entries were replaced by the verified bytes read from S3
    assert all(
        (nodes.dirs[0] / e.chunk_id[:2] / e.chunk_id).read_bytes() != b"\x00" * e.size
        for e in damaged
        if (nodes.dirs[0] / e.chunk_id[:2] / e.chunk_id).exists()
    )
    # what the new node read from S3 it now holds: a second restore there reads it locally
    outputs = run_ranks(
        2, "tests.integration.workers:load_on_nodes", _args(s3_uri, tmp_path, nodes, [0, 2])
    )
    tiers = _bytes_by_tier(tmp_path / "tiers", 2)
    assert tiers[1].get("s3", 0) == 0 and tiers[1].get("local", 0) > 0, tiers


def test_peer_caches_refuse_a_wrong_token_and_the_reader_goes_around_them(
    tmp_path: Path, token: str
) -> None:
    cache = ChunkCache(tmp_path / "c", 1 << 20)
    chunk_id = "ab" * 32
    cache.keep(chunk_id, b"0123456789")
    server = serve_cache(cache, token=token, host="127.0.0.1")
    peer = f"127.0.0.1:{server.server_address[1]}"
    try:
        good = PeerCaches([peer], token=token)
        good.locate([chunk_id, "cd" * 32])
        assert good.read(chunk_id, 2, 5) == b"234"
        assert good.read("cd" * 32, 0, 1) is None  # not held: a miss, not an error
        bad = PeerCaches([peer], token="x" * 32)
        bad.locate([chunk_id])
        assert bad.read(chunk_id, 0, 10) is None
        with pytest.raises(ValueError, match="16 characters"):
            serve_cache(cache, token="short")
    finally:
        server.shutdown()
        server.server_close()
