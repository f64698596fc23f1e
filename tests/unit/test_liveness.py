"""The trainers' liveness pulse, as the sidecar reads it: a stopped process goes silent, a
resumed one beats again, a finished one is not hung, and the directory cannot hang the
reader."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trainer_sidecar.liveness import Pulse, PulseWatch, pulse_path

ROOT = Path(__file__).resolve().parents[2]

PULSING = """
import signal, sys
from pathlib import Path
from trainer_sidecar.liveness import Pulse
pulse = Pulse(Path(sys.argv[1]), int(sys.argv[2]), period_s=0.05)
print("beating", flush=True)
signal.pause()  # until the test stops or kills it
"""


def wait_until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A real process beating rank 3's pulse every 50 ms (a trainer, as far as it goes)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PULSING, str(tmp_path), "3"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "beating"
    yield proc
    proc.kill()
    proc.wait()


def test_a_stopped_trainer_goes_silent_and_a_resumed_one_beats_again(
    tmp_path: Path, trainer: subprocess.Popen[str]
) -> None:
    watch = PulseWatch(tmp_path)
    first = watch.silent_s()
    assert first is not None and first < 0.05, "a pulse first seen counts as just changed"
    wait_until(lambda: (watch.silent_s() or 1.0) < 0.01, "a change seen while it runs")
    os.kill(trainer.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: (watch.silent_s() or 0.0) > 0.5, "the stopped trainer's silence")
        time.sleep(0.3)
        silent = watch.silent_s()
        assert silent is not None and silent > 0.75, "the silence grows while it is stopped"
    finally:
        os.kill(trainer.pid, signal.SIGCONT)
    wait_until(lambda: (watch.silent_s() or 1.0) < 0.2, "the resumed trainer's beat")


def test_the_longest_silence_among_the_pods_trainers_is_reported(
    tmp_path: Path, trainer: subprocess.Popen[str]
) -> None:
    """Two ranks in one pod: the one that stopped decides, however lively the other."""
    stopped = pulse_path(tmp_path, 7)
    stopped.write_bytes(b"1\n")  # rank 7 beat once, then never again
    watch = PulseWatch(tmp_path)
    watch.silent_s()
    wait_until(lambda: (watch.silent_s() or 0.0) > 0.3, "rank 7's silence to show")
    stopped.unlink()  # rank 7 finished
    wait_until(lambda: (watch.silent_s() or 1.0) < 0.2, "only the beating rank left")


def test_a_trainer_that_stops_its_pulse_is_not_hung(tmp_path: Path) -> None:
    pulse = Pulse(tmp_path, 0, period_s=0.05)
    watch = PulseWatch(tmp_path)
    assert watch.silent_s() is not None
    pulse.stop()
    assert not pulse_path(tmp_path, 0).exists()
    assert watch.silent_s() is None
    pulse.stop()  # twice is harmless


def test_no_pulse_is_none(tmp_path: Path) -> None:
    assert PulseWatch(tmp_path).silent_s() is None
    assert PulseWatch(tmp_path / "missing").silent_s() is None


def test_a_fifo_or_a_link_in_place_of_a_pulse_is_not_read(tmp_path: Path) -> None:
    """Reading a FIFO would block the heartbeat's answer forever; a link could point at
    anything. Neither is a pulse."""
    os.mkfifo(tmp_path / "alive-1")
    (tmp_path / "elsewhere").write_bytes(b"7\n")
    (tmp_path / "alive-2").symlink_to(tmp_path / "elsewhere")
    done: list[float | None] = []
    reader = threading.Thread(target=lambda: done.append(PulseWatch(tmp_path).silent_s()))
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "the reader blocked on a FIFO"
    assert done == [None]
