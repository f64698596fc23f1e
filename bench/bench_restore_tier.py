#!/usr/bin/env python3
"""A restore after a node loss, with and without the node-local tier (issue 13).

Three ranks save one checkpoint, each on its own "node": a cache directory of
its own, which the save fills (store/chunk_cache.py). Node 2 is then lost (its
cache is gone) and the next attempt restores, in two ways side by side:

* S3 only: no caches (today's restore);
* node cache: each rank reads its node's cache, then the surviving nodes' caches
  through real peer servers (store/peers.py, HTTP with the job's token), then S3;
* replicated: the same, after each node's sidecar copied the next node's share
  into its own cache (store/replication.py), as it does after every commit.

at the same world size (3: rank 2 rescheduled onto a new, empty node) and at
another (3 -> 2: the survivors reshard). Variants are interleaved and repeated,
every cache is put back as it was before each restore (a restore fills the
cache it reads through), and the median and spread are reported. Every load
is checked against per-tensor checksums taken at save time.

    python bench/bench_restore_tier.py --s3 seaweedfs --json /tmp/tier.json   # 768 MiB
    python bench/bench_restore_tier.py --quick                                # smoke run

By default the node tier is measured three ways in one run, interleaved: through a node
agent per node with each rank reading its own node's chunks from its job's directory
mounted read-only ("mount": the chart's default, the agent's CSI volume; writes and the
peers' reads still go through the agents), through the agents alone over HTTP ("agent":
nodeCache.mount off), and each rank reading its node's directory itself, a peer server
per node ("dir": the tier before the agent). ``--via mount,dir`` runs some of them.
``*_<via>_vs_dir`` ratios are what each costs against the directory. Here the mount is
the directory itself: a bind mount reads the same inodes through the same page cache.

Ratios: tiered time / S3-only time (goal <= 0.3), and the bytes a tiered
restore read from S3 / the lost node's share (goal <= 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_checkpoint as bc

SAVE_WORLD = 3
LOST = 2  # the node that is lost
JOB = ("bench", "tier", "uid-1")
MIB = 1 << 20


# --------------------------------------------------------------------------- ranks


def _config(args: dict[str, Any], *, tiered: bool) -> Any:
    import torch.distributed as dist

    from trainer_sidecar import CheckpointConfig

    rank = dist.get_rank()
    node: dict[str, Any] = {}
    if tiered and args.get("agents"):  # the node's agent, as in a pod (docs/node-agent.md)
        ns, name, uid = JOB
        node = {"node_agent": args["agents"][rank], "job_namespace": ns, "job_name": name,
                "job_uid": uid, "cache_token": args["token"]}  # fmt: skip
        if args.get("mounts"):  # and the job's directory of it, mounted (the CSI volume)
            node["node_cache_mount"] = args["mounts"][rank]
        if args["peers"][rank]:
            node.update(cache_peers=tuple(args["peers"][rank]))
    elif tiered:
        node = {"cache_dir": args["caches"][rank], "cache_max_bytes": 64 << 30}
        if args["peers"][rank]:
            node.update(cache_peers=tuple(args["peers"][rank]), cache_token=args["token"])
    return CheckpointConfig(uri=args["uri"], keep_last=0, **node)


def run_save(args: dict[str, Any]) -> dict[str, Any]:
    from trainer_sidecar import Checkpointer

    model = bc.build_model(bc.StateShape(**args["shape"]))
    bc.fill(model, seed=1)
    want = bc.checksums(model)

    def save() -> None:
        pending = ckpt.save(1, model=model)
        assert pending is not None  # busy policy wait: never skipped
        pending.result()

    with Checkpointer(_config(args, tiered=True)) as ckpt:
        seconds, _ = bc.timed(save)
    return {"checksums": want, "save_seconds": seconds}


def run_load(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from trainer_sidecar import Checkpointer

    model = bc.build_model(bc.StateShape(**args["shape"]))
    bc.fill(model, None)
    ckpt = Checkpointer(_config(args, tiered=args["tiered"]))
    seconds, result = bc.timed(lambda: ckpt.load(model=model))
    bc.check_loaded(model, args["checksums"], args["variant"])
    tiers = {t: bc.sum_over_ranks(result.bytes_by_tier.get(t, 0)) for t in ("local", "peer", "s3")}
    return {"seconds": seconds, "bytes": tiers, "world": dist.get_world_size()}


def worker_main(phase: str, args_path: str) -> None:
    bc.rank_main({"save": run_save, "load": run_load}, phase, args_path)


# --------------------------------------------------------------------------- the driver


@dataclasses.dataclass
class Nodes:
    """Node cache directories, snapshots of them, and what serves them: with ``via`` "agent"
    a node agent per node (trainer_sidecar/agent/, as on a cluster: the ranks reach their
    node's agent over HTTP, and the survivors' sidecars name their agents to a restoring
    rank), "mount" the same with each rank reading its own node's chunks from the job's
    directory (the agent's CSI volume), with "dir" each rank reads its node's directory
    itself and a peer server per node serves it (the tier before the node agent)."""

    root: Path
    via: str = "agent"
    key: bytes = dataclasses.field(default_factory=lambda: secrets.token_bytes(32))
    servers: dict[int, Any] = dataclasses.field(default_factory=dict)
    agents: dict[int, Any] = dataclasses.field(default_factory=dict)

    @property
    def token(self) -> str:
        from ctj_contract.tokens import job_token

        return job_token(self.key, *JOB)

    def dir(self, node: int) -> Path:
        return self.root / f"node-{node}"

    def snapshot(self, name: str) -> None:
        for n in range(SAVE_WORLD + 1):
            self.dir(n).mkdir(parents=True, exist_ok=True)
            shutil.copytree(self.dir(n), self.root / name / str(n), dirs_exist_ok=True)

    def reset(self, name: str) -> None:
        """Every node's cache as snapshot ``name`` had it, node LOST's gone, a new node
        (SAVE_WORLD) empty: a restore reads through and would otherwise warm the next."""
        self.stop_agents()
        for n in range(SAVE_WORLD + 1):
            shutil.rmtree(self.dir(n), ignore_errors=True)
            if n == LOST or n == SAVE_WORLD:
                self.dir(n).mkdir(parents=True)
            else:
                shutil.copytree(self.root / name / str(n), self.dir(n))
        os.sync()  # the copies' writeback would otherwise land in the timed restore
        self.start_agents()

    def start_agents(self) -> None:
        """An agent per node (its index read from the disk, as an agent restarted does)."""
        from trainer_sidecar.agent.server import serve_agent
        from trainer_sidecar.agent.store import NodeStore

        if not self.agented:
            return
        self.stop_agents()
        for n in range(SAVE_WORLD + 1):
            self.dir(n).mkdir(parents=True, exist_ok=True)
            store = NodeStore(self.dir(n), 64 << 30)
            self.agents[n] = serve_agent(store, key=self.key, host="127.0.0.1")

    def stop_agents(self) -> None:
        for server in self.agents.values():
            server.shutdown()
            server.server_close()
        self.agents = {}

    @property
    def agented(self) -> bool:
        return self.via in ("agent", "mount")

    def agent(self, n: int) -> str:
        return f"127.0.0.1:{self.agents[n].server_address[1]}"

    def serve(self, nodes: list[int]) -> None:
        """What each pod on ``nodes`` serves its peers: its node's cache ("dir"), or where
        its node's agent is ("agent")."""
        from trainer_sidecar.store.chunk_cache import ChunkCache
        from trainer_sidecar.store.peers import serve_cache

        self.stop()
        for n in nodes:
            if self.agented:
                self.servers[n] = serve_cache(
                    None, token=self.token, host="127.0.0.1", node_agent=self.agent(n)
                )  # the agent's address is stable: the agents restart on the same object
            else:
                cache = ChunkCache(self.dir(n), 64 << 30)
                self.servers[n] = serve_cache(cache, token=self.token, host="127.0.0.1")

    def stop(self) -> None:
        for server in self.servers.values():
            server.shutdown()
            server.server_close()
        self.servers = {}

    def address(self, n: int) -> str:
        return f"127.0.0.1:{self.servers[n].server_address[1]}"

    def placement(self, nodes: list[int]) -> dict[str, Any]:
        """Rank r on nodes[r]: its cache, and the peers among the other nodes that are up."""
        if self.agented:
            self.serve(sorted(self.servers) or [])  # the agents moved: say where they are now
        return {
            "caches": [str(self.dir(n)) for n in nodes],
            "agents": [self.agent(n) for n in nodes] if self.agented else None,
            "mounts": [str(self.dir(n).joinpath(*JOB)) for n in nodes]
            if self.via == "mount"
            else None,
            "peers": [
                [self.address(p) for p in nodes if p != n and p in self.servers] for n in nodes
            ],  # fmt: skip
            "token": self.token,
        }

    def replicate(self, manifest: Any) -> int:
        """What each node's sidecar does after the commit (store/replication.py): copy
        the next node's share from its cache; the bytes copied."""
        from trainer_sidecar.store.agent_client import AgentCache, job_path
        from trainer_sidecar.store.chunk_cache import ChunkCache, NodeChunks
        from trainer_sidecar.store.peers import PeerCaches
        from trainer_sidecar.store.replication import replicate

        self.serve(list(range(SAVE_WORLD)))
        copied = 0
        path = job_path(*JOB) if self.agented else None
        for n in range(SAVE_WORLD):
            others = [self.address(p) for p in range(SAVE_WORLD) if p != n]
            peers = PeerCaches(others, token=self.token, job_path=path)
            cache: NodeChunks = (
                AgentCache(self.agent(n), job_path(*JOB), token=self.token)
                if self.agented
                else ChunkCache(self.dir(n), 64 << 30)
            )
            copied += replicate(manifest, cache, peers, own=n, pods=SAVE_WORLD)
        return copied


VIAS = ("mount", "agent", "dir")
"""The node tier through a node agent per node with the job's directory mounted (as on a
cluster with the chart's defaults), through the agents over HTTP alone, or each rank
reading its node's directory itself (the tier before the agent)."""

VARIANTS = {  # name: (tiered, the cache snapshot, the nodes the restoring ranks run on)
    "s3_only_w3": (False, "saved", [0, 1, SAVE_WORLD]),
    "node_cache_w3": (True, "saved", [0, 1, SAVE_WORLD]),
    "replicated_w3": (True, "replicated", [0, 1, SAVE_WORLD]),
    "s3_only_w2": (False, "saved", [0, 1]),
    "node_cache_w2": (True, "saved", [0, 1]),
    "replicated_w2": (True, "replicated", [0, 1]),
}


def read_manifest(endpoint: str, uri: str) -> Any:
    from trainer_sidecar.load.checks import read_manifest as read
    from trainer_sidecar.store.base import Location
    from trainer_sidecar.store.s3 import S3Settings, S3Store

    settings = S3Settings(endpoint_url=endpoint)
    return read(S3Store(Location.parse(uri), settings, credentials=bc.CREDENTIALS), 1)


def lost_share(manifest: Any) -> int:
    """Bytes of the files the lost node's rank saved."""
    sizes = manifest.file_sizes()
    return sum(size for name, size in sizes.items() if name.startswith(f"__{LOST}_"))


def run(opts: argparse.Namespace) -> dict[str, Any]:
    shape = bc.StateShape.for_total(opts.total_mib * MIB, opts.tensors)
    root = Path(tempfile.mkdtemp(prefix="ctj-bench-tier-"))
    vias: tuple[str, ...] = opts.via
    tiers = {via: Nodes(root / via, via=via) for via in vias}
    runs: dict[str, list[dict[str, Any]]] = {}
    replicated: dict[str, int] = {}
    checksums: list[Any] = []
    try:
        with bc.s3_server(opts.endpoint_url, opts.s3) as (endpoint, server, _):
            env = bc.project_env(endpoint)
            bucket = bc.create_bucket(endpoint)
            bc.log(f"state: {shape.total_bytes / MIB:.0f} MiB over {SAVE_WORLD} ranks; {server}")
            base: dict[str, dict[str, Any]] = {}
            for via, nodes in tiers.items():  # a save per node tier, each filling its caches
                nodes.start_agents()
                base[via] = {"shape": dataclasses.asdict(shape), "uri": f"s3://{bucket}/{via}"}
                placed = base[via] | nodes.placement([0, 1, 2])
                saved = bc.run_world(SAVE_WORLD, "save", placed, env, script=__file__)
                checksums.append(saved["checksums"])  # the same state each time
                manifest = read_manifest(endpoint, base[via]["uri"])
                share = lost_share(manifest)
                nodes.snapshot("saved")
                replicated[via] = nodes.replicate(manifest)
                nodes.snapshot("replicated")
                nodes.serve([n for n in range(SAVE_WORLD) if n != LOST])
            assert all(c == checksums[0] for c in checksums), "the saves' states differ"
            for i in range(opts.repeats):  # interleaved: every variant of every tier per round
                for variant, via in _rounds(vias):
                    tiered, snapshot, on = VARIANTS[variant]
                    nodes = tiers[via]
                    nodes.reset(snapshot)
                    name = _name(variant, via, vias)
                    bc.log(f"repeat {i + 1}/{opts.repeats}: {name}")
                    args = base[via] | nodes.placement(on) | {
                        "tiered": tiered, "variant": name, "checksums": checksums[0]
                    }  # fmt: skip
                    world = bc.run_world(len(on), "load", args, env, script=__file__)
                    runs.setdefault(name, []).append(world)
    finally:
        for nodes in tiers.values():
            nodes.stop()
            nodes.stop_agents()
        shutil.rmtree(root, ignore_errors=True)
    summary = {name: _summary(r) for name, r in runs.items()}
    ratios = {}
    for tier in ("node_cache", "replicated"):
        for w in ("w3", "w2"):
            s3 = summary[f"s3_only_{w}"]
            for via in vias:
                ours = summary[_name(f"{tier}_{w}", via, vias)]
                suffix = f"_{via}" if len(vias) > 1 else ""
                ratios[f"{tier}_time_ratio_vs_s3_only_{w}{suffix}"] = (
                    ours["seconds_median"] / s3["seconds_median"]
                )
                ratios[f"{tier}_s3_bytes_ratio_vs_lost_share_{w}{suffix}"] = (
                    ours["bytes"]["s3"] / share
                )
    targets = {
        name: {"target": "<= 0.3" if "time" in name else "<= 1.0",
               "met": value <= (0.3 if "time" in name else 1.0)}
        for name, value in ratios.items()
    }  # fmt: skip
    if "dir" in vias and len(vias) > 1:  # what each way costs against the directory's
        for tier in ("node_cache", "replicated"):
            for w in ("w3", "w2"):
                direct = summary[_name(f"{tier}_{w}", "dir", vias)]
                for via in vias:
                    if via != "dir":
                        ours = summary[_name(f"{tier}_{w}", via, vias)]
                        ratios[f"{tier}_{w}_time_ratio_{via}_vs_dir"] = (
                            ours["seconds_median"] / direct["seconds_median"]
                        )
    return {
        "command": " ".join(["python", "bench/bench_restore_tier.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "total_bytes": shape.total_bytes,
            "save_world_size": SAVE_WORLD,
            "lost_node": LOST,
            "repeats": opts.repeats,
            "quick": opts.quick,
            "via": list(vias),
        },  # fmt: skip
        "server": server,
        "machine": bc.machine(),
        "save_seconds": saved["save_seconds"],
        "lost_share_bytes": share,
        "replicated_bytes": replicated[vias[0]],
        "variants": summary,
        "ratios": ratios,
        "targets": targets,
    }


def _rounds(vias: tuple[str, ...]) -> list[tuple[str, str]]:
    """One round's (variant, tier): the S3-only restores once (no node tier is read), the
    tiered ones once per tier, in the order VARIANTS lists them."""
    return [
        (variant, via)
        for variant, (tiered, _, _) in VARIANTS.items()
        for via in (vias if tiered else vias[:1])
    ]


def _name(variant: str, via: str, vias: tuple[str, ...]) -> str:
    tiered = VARIANTS[variant][0]
    return f"{variant}_{via}" if tiered and len(vias) > 1 else variant


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    return {
        "seconds": seconds,
        "seconds_median": statistics.median(seconds),
        "seconds_spread": max(seconds) - min(seconds),
        "bytes": runs[-1]["bytes"],  # the same every repeat (the caches are reset)
        "world": runs[-1]["world"],
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"lost node's share: {report['lost_share_bytes'] / MIB:.1f} MiB "
        f"(state {report['config']['total_bytes'] / MIB:.0f} MiB); peer replication copied "
        f"{report['replicated_bytes'] / MIB:.1f} MiB; {report['server']}",
        f"{'restore':<22}{'ranks':>6}{'median s':>10}{'spread':>8}"
        f"{'MiB local':>11}{'MiB peer':>10}{'MiB s3':>9}",
        "-" * 74,
    ]
    for name, v in report["variants"].items():
        b = v["bytes"]
        lines.append(
            f"{name:<22}{v['world']:>6}{v['seconds_median']:>10.2f}{v['seconds_spread']:>8.2f}"
            f"{b['local'] / MIB:>11.1f}{b['peer'] / MIB:>10.1f}{b['s3'] / MIB:>9.1f}"
        )
    lines += bc.ratio_lines(report, width=54)
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures and ratios here")
    parser.add_argument("--quick", action="store_true", help="24 MiB, 1 repeat: a smoke run")
    parser.add_argument("--total-mib", type=int, default=768, help="state size (default 768)")
    parser.add_argument("--tensors", type=int, default=12, help="tensors in the state")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every variant")
    parser.add_argument(
        "--via", type=_vias, default=VIAS,
        help="comma-separated, side by side and interleaved (default: mount,agent,dir): "
        "the node tier through a node agent per node with each rank reading its own node's "
        "chunks from the job's mounted directory (the chart's default), through the agents "
        "over HTTP alone, or each rank reading its node's directory itself (the tier "
        "before the agent), with each one's time over the directory's",
    )  # fmt: skip
    bc.add_s3_arguments(parser)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.total_mib, opts.repeats = 24, 1
    return opts


def _vias(raw: str) -> tuple[str, ...]:
    vias = tuple(dict.fromkeys(v.strip() for v in raw.split(",") if v.strip()))
    unknown = [v for v in vias if v not in VIAS]
    if not vias or unknown:
        raise argparse.ArgumentTypeError(f"{raw!r}: use some of {','.join(VIAS)}")
    return vias


def main(argv: list[str] | None = None) -> int:
    return bc.script_main(argv, parse_args=parse_args, run=run, table=table)


if __name__ == "__main__":
    sys.exit(main())
