"""The README's first command: the demo must run end to end and prove the resume."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_local_demo_resumes_at_a_new_world_size_from_the_last_commit() -> None:
    out = subprocess.run(
        [sys.executable, "examples/local_demo.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "killed rank 1 with SIGKILL" in out.stdout
    assert "last committed checkpoint: step 20 (world size 2" in out.stdout
    assert "restored step 20" in out.stdout and "== the loss logged at commit" in out.stdout
    assert "(world size 3)" in out.stdout and "done: trained to step 60" in out.stdout
