"""What runs without torch: the checkpoint sidecar (its image has none), the operator, and
the CLI's store commands (ls, show, gc, rm). Each is checked in a fresh interpreter:
importing it loads no torch module, and the sidecar commits a checkpoint, and the store
commands read it, with torch made unimportable. verify and export need torch: without it
they say, in one line, what to install."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainer_sidecar import CheckpointConfig, Checkpointer
from trainer_sidecar.store import repository as repo

ROOT = Path(__file__).resolve().parents[2]
# sys.modules[name] = None: `import torch` (and every torch.*) raises ImportError, and
# importlib.util.find_spec("torch") answers None, as where torch is not installed
NO_TORCH = "import sys; sys.modules['torch'] = None\n"

ENTRY_POINTS = {
    # the sidecar as the pod runs it (python -m trainer_sidecar sidecar: the CLI), its
    # startup probe (trainer_sidecar.metrics wait-ready), its heartbeat's Kubernetes client
    "sidecar": ["trainer_sidecar.cli", "trainer_sidecar.sidecar", "trainer_sidecar.metrics",
                "trainer_sidecar.heartbeat", "kubernetes.client"],
    "operator": ["ctj_operator.__main__"],
    "cli store commands": ["trainer_sidecar.cli", "trainer_sidecar.store.s3",
                           "trainer_sidecar.store.local", "trainer_sidecar.store.repository"],
}  # fmt: skip


def _env() -> dict[str, str]:
    """This environment without CTJ_* settings (a stray CTJ_HEARTBEAT_LEASE would start a
    heartbeat), with the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTJ_")}
    paths = [str(ROOT), str(ROOT / "operator"), str(ROOT / "contract")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    return env


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("what", sorted(ENTRY_POINTS))
def test_importing_it_loads_no_torch(what: str) -> None:
    code = (
        "import importlib, json, sys\n"
        f"for m in {ENTRY_POINTS[what]!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [], f"the {what} import torch: {proc.stdout[:300]}"


def _wait(condition: Callable[[], object], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# Runs `ctj ARGS...` for each ARGS in argv[1] (JSON), in one interpreter with torch
# unimportable; prints each one's exit status, stdout and stderr.
_CTJ_DRIVER = """
import contextlib, io, json
from trainer_sidecar.cli import main
results = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    results.append({"rc": rc, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
"""


def _ctj(*commands: list[str]) -> list[dict[str, object]]:
    """The ``ctj`` command's results for each of ``commands``, with torch unimportable."""
    proc = _python(NO_TORCH + _CTJ_DRIVER, json.dumps(commands))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_sidecar_and_the_store_commands_work_without_torch(tmp_path: Path) -> None:
    uri, staging = f"file://{tmp_path / 'store'}", tmp_path / "staging"
    (tmp_path / "store").mkdir()
    model = torch.nn.Linear(64, 32)
    trainer = Checkpointer(CheckpointConfig(uri=uri, sidecar=True, staging_dir=str(staging)))
    trainer.save(1, model=model)  # staged, for a sidecar to persist
    trainer.close(wait_for_commit=False)

    log = tmp_path / "sidecar.log"
    with open(log, "w") as err:
        sidecar = subprocess.Popen(
            [sys.executable, "-c", NO_TORCH + "from trainer_sidecar.cli import main; "
             "sys.exit(main())", "sidecar", "--uri", uri, "--staging-dir", str(staging),
             "--grace", "10"],
            cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        store = Checkpointer(CheckpointConfig(uri=uri)).store
        _wait(lambda: sidecar.poll() is not None or repo.committed_steps(store) == [1],
              "the sidecar to commit step 1")  # fmt: skip
        assert repo.committed_steps(store) == [1], log.read_text()[-3000:]
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]

    out = tmp_path / "out"
    ls, show, gc, verify, export, rm = _ctj(
        ["checkpoints", "ls", uri, "--json"],
        ["checkpoints", "show", uri],
        ["checkpoints", "gc", uri, "--dry-run", "--json"],
        ["checkpoints", "verify", uri],
        ["checkpoints", "export", uri, str(out)],
        ["checkpoints", "rm", uri, "1"],
    )
    assert ls["rc"] == 0, ls
    assert [row["step"] for row in json.loads(str(ls["out"]))] == [1]
    assert show["rc"] == 0 and str(show["out"]).startswith("step 1 "), show
    assert gc["rc"] == 0 and json.loads(str(gc["out"]))["dry_run"] is True, gc
    for command, result in (("verify", verify), ("export", export)):
        assert result == {
            "rc": 2,
            "out": "",
            "err": f"ctj: error: ctj checkpoints {command} needs torch: pip install "
            "ctj[trainer] (or run it in the trainer image)\n",
        }
    assert not out.exists()
    assert rm["rc"] == 0, rm
    assert repo.committed_steps(store) == []
