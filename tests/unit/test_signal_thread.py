"""The sidecar handles SIGTERM on a thread of its own (signals.SignalThread), never inside
a Python signal handler: a handler runs in the main thread between two bytecodes, maybe
while that thread holds the lock of the very Event the handler would set (the chaos test
caught a sidecar hung so, in ``Event.wait`` inside ``Persister.run``)."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import ROOT

CHILD = r"""
import signal, sys, threading, time
from trainer_sidecar.signals import SignalThread

main = threading.main_thread()
wake = threading.Event()
seen = []

def on_signal(signum):
    seen.append((signum, threading.current_thread() is main))
    wake.set()  # the lock the main thread keeps taking below: fine from another thread

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what it restores: late signals do nothing
before = signal.getsignal(signal.SIGTERM)
with SignalThread((signal.SIGTERM,), on_signal):
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while len(seen) < 50 and time.monotonic() < deadline:
        wake.wait(0.0001)  # holds wake's Condition lock most of the time
        wake.clear()
restored = signal.getsignal(signal.SIGTERM) is before and signal.set_wakeup_fd(-1) == -1
print(len(seen), all(sig == signal.SIGTERM and not in_main for sig, in_main in seen), restored)
"""


def test_signals_are_handled_off_the_main_thread_and_the_handlers_restored() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while child.poll() is None and time.monotonic() < deadline:
        child.send_signal(15)  # SIGTERM; the child counts 50, then exits by itself
        time.sleep(0.002)
    assert child.wait(30) == 0
    count, off_main, restored = child.stdout.read().split()
    assert int(count) >= 50 and off_main == "True" and restored == "True"
