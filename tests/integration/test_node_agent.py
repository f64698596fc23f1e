"""The node tier through node agents: real agent processes on loopback, real ranks, real S3.

Each "node" runs ``python -m trainer_sidecar agent`` over a directory of its own; the
ranks reach their node's agent the way a pod does (CTJ_NODE_AGENT_HOST and the job's
identity and token), and a restoring rank finds the other nodes' agents through each
peer's discovery server (what a sidecar serves on 9402). The agent's job lister is a
file the test controls: the Kubernetes one runs on kind (tests/e2e/test_node_agent.py).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ctj_contract.tokens import job_token

from tests.integration.node_mounter import Mounter, needs_root, short_tmp
from tests.integration.ranks import run_ranks
from trainer_sidecar.format.manifest import Manifest, manifest_key
from trainer_sidecar.store.agent_client import AgentCache, job_path
from trainer_sidecar.store.peers import PeerCacheServer, serve_cache
from trainer_sidecar.store.s3 import open_store

pytestmark = pytest.mark.integration

STEP = 5
PACK = 256 << 10
JOB = ("ml", "demo", "uid-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.05)


class Agent:
    """One node: an agent process over its directory."""

    def __init__(self, root: Path, key_file: Path, *args: str) -> None:
        self.root, self.port = root, free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(root.with_suffix(".log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer_sidecar", "agent", "--root", str(root),
             "--host", "127.0.0.1", "--port", str(self.port), "--key-file", str(key_file),
             *args],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(self._up, 30, f"agent {self.address} up")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the agent exited: {self.root.with_suffix('.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.log.close()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "key"
    path.write_text(secrets.token_hex(32))
    return path


@pytest.fixture
def token(key_file: Path) -> str:
    return job_token(key_file.read_text().strip().encode(), *JOB)


@pytest.fixture
def agents(tmp_path: Path, key_file: Path) -> Iterator[list[Agent]]:
    started = [Agent(tmp_path / f"node-{i}", key_file, "--no-gc") for i in range(3)]
    yield started
    for agent in started:
        if agent.proc.poll() is None:
            agent.stop()


def _args(s3_uri: str, tmp_path: Path, token: str, agents: list[Agent], placement: list[int],
          peers: list[list[str]] | None) -> dict[str, object]:  # fmt: skip
    return {
        "kind": "big",
        "uri": s3_uri,
        "step": STEP,
        "ref": str(tmp_path / "ref.pt"),
        "out": str(tmp_path / "tiers"),
        "agents": [agents[n].address for n in placement],
        "job": list(JOB),
        "token": token,
        "peers": peers,
        "config": {"block_size": 1 << 16, "chunk_size": 1 << 18},
    }


def _share(s3_uri: str, rank: int) -> int:
    manifest = Manifest.from_bytes(open_store(s3_uri).get(manifest_key(STEP)))
    return sum(s for n, s in manifest.file_sizes().items() if n.startswith(f"__{rank}_"))


@pytest.mark.parametrize("via", ["http", "mount"])
def test_a_restore_reads_the_node_agent_then_the_peers_agents_then_s3(
    s3_uri: str, tmp_path: Path, token: str, agents: list[Agent], via: str
) -> None:
    """``via`` "mount": each surviving rank reads its own node's chunks through its job's
    directory mounted read-only by the node's mounter (the agent's CSI endpoint), and its
    own agent's address is one nothing listens on: its local bytes came through the mount."""
    if via == "mount":
        needs_root()
    run_ranks(
        3, "tests.integration.workers:save_on_nodes",
        _args(s3_uri, tmp_path, token, agents, [0, 1, 2], None),
    )  # fmt: skip
    # every rank's chunks are on its node, in the job's directory (uid included)
    for n in range(3):
        assert list((tmp_path / f"node-{n}" / "ml" / "demo" / "uid-1").glob("??/*"))
    agents[2].stop()  # node 2 is lost, its disk too
    shutil.rmtree(tmp_path / "node-2")
    # each surviving pod's sidecar says where its node's agent is (GET /v1/node)
    sidecars: list[PeerCacheServer] = [
        serve_cache(None, token=token, host="127.0.0.1", node_agent=agents[n].address)
        for n in (0, 1)
    ]
    with contextlib.ExitStack() as stack:
        for s in sidecars:
            stack.callback(s.server_close)
            stack.callback(s.shutdown)
        addresses = [f"127.0.0.1:{s.server_address[1]}" for s in sidecars]
        peers = [[addresses[1]], [addresses[0]]]
        args = _args(s3_uri, tmp_path, token, agents, [0, 1], peers)
        if via == "mount":
            kubelets = stack.enter_context(short_tmp())
            mounters = [Mounter(tmp_path / f"node-{n}", kubelets / f"k{n}") for n in (0, 1)]
            for mounter in mounters:
                stack.callback(mounter.stop)
            args["mounts"] = [str(m.publish(*JOB)) for m in mounters]
            args["agents"] = ["127.0.0.1:1", "127.0.0.1:1"]
        outputs = run_ranks(2, "tests.integration.workers:load_on_nodes", args)
    assert "bitwise equal at world size 2" in outputs[0]
    tiers = [json.loads(Path(f"{tmp_path / 'tiers'}.{r}.json").read_text()) for r in range(2)]
    share = _share(s3_uri, 2)
    assert all(t.get("s3", 0) <= share for t in tiers), (tiers, share)
    assert 0 < sum(t.get("s3", 0) for t in tiers) <= share + PACK, (tiers, share)
    assert all(t.get("local", 0) > 0 for t in tiers), tiers
    assert sum(t.get("peer", 0) for t in tiers) > 0, tiers


def test_a_wrong_token_is_refused_and_reads_nothing(
    tmp_path: Path, token: str, agents: list[Agent]
) -> None:
    path = job_path(*JOB)
    mine = AgentCache(agents[0].address, path, token=token)
    mine.keep("ab" * 32, b"0123456789")
    assert mine.held(["ab" * 32]) == {"ab" * 32}
    forged = AgentCache(agents[0].address, path, token=secrets.token_hex(32))
    assert forged.held(["ab" * 32]) == set() and forged.read("ab" * 32, 0, 10) is None
    forged.keep("cd" * 32, b"x")
    assert mine.held(["cd" * 32]) == set()  # the forged write left nothing


def test_a_deleted_jobs_data_is_removed_and_the_bound_is_per_node_across_jobs(
    tmp_path: Path, key_file: Path
) -> None:
    key = key_file.read_text().strip().encode()
    jobs_file = tmp_path / "jobs.json"
    jobs_file.write_text(json.dumps({"uids": ["uid-a", "uid-b"]}))
    agent = Agent(tmp_path / "node", key_file, "--jobs-file", str(jobs_file),
                  "--gc-period", "0.2", "--max-bytes", "1Mi")  # fmt: skip
    try:
        a = AgentCache(agent.address, job_path("ml", "a", "uid-a"),
                       token=job_token(key, "ml", "a", "uid-a"))  # fmt: skip
        b = AgentCache(agent.address, job_path("ml", "b", "uid-b"),
                       token=job_token(key, "ml", "b", "uid-b"))  # fmt: skip
        piece = 300 << 10
        a.keep("a1" * 32, bytes(piece))
        a.keep("a2" * 32, bytes(piece))
        b.keep("b1" * 32, bytes(piece))
        b.keep("b2" * 32, bytes(piece))  # 1.2 MiB > 1 MiB: the node's oldest (a's) goes
        assert a.held(["a1" * 32, "a2" * 32]) == {"a2" * 32}
        assert b.held(["b1" * 32, "b2" * 32]) == {"b1" * 32, "b2" * 32}
        on_disk = sum(f.stat().st_size for f in (tmp_path / "node").rglob("*") if f.is_file())
        assert on_disk <= 1 << 20
        # job b is deleted: its directory goes within a few collection periods
        jobs_file.write_text(json.dumps({"uids": ["uid-a"]}))
        gone = tmp_path / "node" / "ml" / "b"
        wait_for(lambda: not gone.exists(), 10, "job b's directory removed")
        assert (tmp_path / "node" / "ml" / "a" / "uid-a").is_dir()
    finally:
        agent.stop()
