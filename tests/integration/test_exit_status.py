"""A finished rank exits 0: no thread of ours outlives close(), nothing aborts at exit.

In a pod a trainer that aborts at interpreter exit ("terminate called without an
active exception", SIGABRT) is a Failed pod although its work was done. CPython 3.11
ends a daemon thread that retakes the GIL while the interpreter finalizes with
pthread_exit; torch's bindings retake it in a noexcept destructor, so a daemon thread
still inside a torch op at exit aborts the process (test_daemon_torch_thread_aborts
shows the mechanism). So every thread the library starts must have ended by the time
close() returns, and the rank programs of the resharding test must exit 0, clean. (torch's
own gloo threads outlive destroy_process_group and can abort the same way: rank programs
end with trainer_sidecar.rank_exit.exit_rank, which skips finalization.)
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.integration.ranks import run_ranks

pytestmark = pytest.mark.integration

ROUNDS = 2


def save_close_and_check_threads(args: dict[str, Any]) -> None:
    """Rank: workers.save with /metrics on and an explicit close(), after which no thread
    the Checkpointer started may be alive."""
    import torch
    import torch.distributed as dist

    from tests.integration.workers import build, config, full_state, train
    from trainer_sidecar import Checkpointer

    before = set(threading.enumerate())
    model, opt = build(args["kind"], seed=0)
    train(model, opt, 2)
    ckpt = Checkpointer(config(dict(args, config={"metrics_port": 0})))
    extra = {"step": args["step"], "pos": 7}
    pending = ckpt.save(args["step"], model=model, optimizer=opt, extra=extra)
    assert pending is not None
    ref = full_state(model, opt)
    train(model, opt, 1)
    pending.result()
    ckpt.close()
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"rank {dist.get_rank()}: threads alive after close(): {left}"
    if dist.get_rank() == 0:
        torch.save(ref, args["ref"])


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_rank_processes_exit_cleanly(kind: str, s3_uri: str, tmp_path: Path) -> None:
    """Save, close, exit; then load and train a step right before exit (the resharding
    test's ranks), each ROUNDS times: every rank exits 0 and nothing aborts."""
    for i in range(ROUNDS):
        args = {"kind": kind, "uri": f"{s3_uri}-{i}", "step": 5, "ref": str(tmp_path / f"{i}.pt")}
        target = "tests.integration.test_exit_status:save_close_and_check_threads"
        outputs = run_ranks(2, target, args, fresh=True)  # the interpreter's own exit
        outputs += run_ranks(2, "tests.integration.workers:load_and_compare", args, fresh=True)
        for rank, out in enumerate(outputs):
            assert "terminate called" not in out, f"round {i}, process {rank}:\n{out[-3000:]}"


DAEMON_TORCH = """
import threading, time, torch
t = torch.zeros(1 << 22)
def spin():
    while True:
        t.clone()  # a torch op: it releases the GIL and retakes it in a noexcept destructor
threading.Thread(target=spin, daemon=True).start()
time.sleep(0.5)
"""


def test_daemon_torch_thread_aborts_at_exit(tmp_path: Path) -> None:
    """Why the threads above must be gone: a daemon thread in a torch op at exit aborts."""
    script = tmp_path / "daemon_torch.py"
    script.write_text(DAEMON_TORCH)
    cmd = [sys.executable, str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
        pytest.skip("this interpreter does not end daemon threads with pthread_exit (3.14+)")
    assert "terminate called without an active exception" in done.stderr, done.stderr
