"""The local end-to-end demo: train, lose a rank, resume at another world size.

What it shows, on CPU with nothing but this repo's environment:
  1. an embedded S3 server starts on loopback (moto's server mode);
  2. examples/train_fsdp.py trains an FSDP2 model on 2 ranks, saving every 10
     steps: a save blocks training only while the state is copied to host
     memory; upload and commit (incremental deltas) run in the background;
  3. rank 1 is killed with SIGKILL mid-run; the gang is torn down, as the
     operator does when a node is lost;
  4. the job restarts on 3 ranks; they load the last committed checkpoint,
     resharded 2 -> 3, and training continues from that step. The eval loss
     right after the restore equals the one logged when that step committed.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from ctj_devcluster.local_s3 import LocalS3, free_port

from trainer_sidecar.store import repository
from trainer_sidecar.store.s3 import S3Settings, open_store

HERE = Path(__file__).resolve().parent
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Gang:
    """One attempt: world_size trainer processes, their JSON events on a queue."""

    def __init__(self, world: int, env: dict[str, str]) -> None:
        self.events: queue.Queue[dict] = queue.Queue()
        port = str(free_port())
        self.procs = []
        for rank in range(world):
            rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "train_fsdp.py")], env=rank_env,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
            threading.Thread(target=self._pump, args=(proc,), daemon=True).start()
            self.procs.append(proc)

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                pass

    def next_event(self, deadline: float) -> dict | None:
        try:
            return self.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def stop(self, grace_s: float = 15.0) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> int:
    say("starting an embedded S3 server on loopback")
    s3 = LocalS3.start()
    bucket = f"ctj-demo-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(bucket)
    uri = f"s3://{bucket}/jobs/demo"
    os.environ.update(s3.env())  # this process reads the store too
    env = dict(os.environ, **s3.env(), CTJ_CHECKPOINT_URI=uri, CTJ_CHECKPOINT_MODE="incremental",
               CTJ_TOTAL_STEPS="60", CTJ_SAVE_EVERY="10", CTJ_STEP_DELAY_S="0.05")
    commits: dict[int, float] = {}  # committed step -> eval loss when it was saved
    staged_loss: dict[int, float] = {}
    try:
        say(f"attempt 1: 2 ranks, checkpoints to {uri} every 10 steps")
        gang = Gang(2, env)
        deadline = time.monotonic() + 300
        killed_at = None
        while killed_at is None:
            ev = gang.next_event(deadline)
            if ev is None:
                raise SystemExit("demo: attempt 1 made no progress")
            if ev["event"] == "staged":
                staged_loss[ev["step"]] = ev["eval_loss"]
                say(f"  saved step {ev['step']}: training blocked {ev['stall_seconds']}s "
                    f"(eval loss {ev['eval_loss']:.5f}); uploading in the background")
            elif ev["event"] == "committed":
                commits[ev["step"]] = staged_loss[ev["step"]]
                say(f"  committed step {ev['step']} ({ev['mode']}, "
                    f"{ev['uploaded_bytes']:,} of {ev['logical_bytes']:,} bytes uploaded, "
                    f"{ev['seconds']}s after the save)")
            elif ev["event"] == "step" and ev["step"] % 5 == 0:
                say(f"  step {ev['step']} loss {ev['loss']:.5f}")
            if ev["event"] == "step" and ev["step"] >= 25 and 20 in commits:
                gang.procs[1].send_signal(signal.SIGKILL)
                killed_at = ev["step"]
        say(f"!! killed rank 1 with SIGKILL at step {killed_at}; tearing the gang down")
        gang.stop()

        store = open_store(uri, S3Settings.from_env(endpoint_url=s3.endpoint))
        last = repository.latest_manifest(store)
        assert last is not None
        say(f"last committed checkpoint: step {last.step} (world size {last.world_size}, "
            f"mode {last.mode})")

        say("attempt 2: 3 ranks, restoring with a 2 -> 3 resharding load")
        gang = Gang(3, env)
        deadline = time.monotonic() + 300
        restored = done = None
        while done is None:
            ev = gang.next_event(deadline)
            if ev is None:
                raise SystemExit("demo: attempt 2 made no progress")
            if ev["event"] == "restored":
                restored = ev
                same = ev["eval_loss"] == commits.get(ev["step"])
                say(f"  restored step {ev['step']} in {ev['seconds']}s "
                    f"({ev['bytes_fetched']:,} bytes fetched); eval loss {ev['eval_loss']:.5f} "
                    f"{'== the loss logged at commit' if same else '(differs from the commit!)'}")
            elif ev["event"] == "committed":
                say(f"  committed step {ev['step']} ({ev['mode']}, "
                    f"{ev['uploaded_bytes']:,} bytes uploaded)")
            elif ev["event"] == "staged":
                say(f"  saved step {ev['step']}: training blocked {ev['stall_seconds']}s")
            elif ev["event"] == "step" and ev["step"] % 10 == 5:
                say(f"  step {ev['step']} loss {ev['loss']:.5f} (world size {ev['world_size']})")
            elif ev["event"] == "done":
                done = ev
        gang.stop()
        if restored is None or restored["eval_loss"] != commits.get(restored["step"]):
            say("FAILED: the restore did not reproduce the committed state")
            return 1
        say(f"done: trained to step {done['step']}, final eval loss {done['eval_loss']:.5f}")
        return 0
    finally:
        s3.stop()


if __name__ == "__main__":
    sys.exit(main())
