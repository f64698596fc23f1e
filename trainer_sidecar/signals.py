"""Signals handled on a thread of their own, for the daemons (the sidecar, the node
agent's server and mounter).

A daemon whose main thread only waits for SIGTERM must not wait in ``Event.wait()`` with a
Python-level handler that sets the event:

- the handler runs in the main thread between two of its bytecodes, possibly while it
  holds the Event's lock: ``set()`` then waits for that lock forever (the chaos test
  caught a sidecar hung so on SIGTERM);
- a signal the kernel delivers to another thread (grpc's, for one) does not interrupt
  the main thread's lock wait, so the handler may not run at all.

Here the C-level handler only writes the signal number to a socket
(``signal.set_wakeup_fd``), whichever thread it runs on; a thread reads the number and
calls ``on_signal``, taking locks like any other thread.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from typing import Any


class SignalThread:
    """Handles ``signals`` on a thread of its own, not in a signal handler (see the
    module's docstring): ``on_signal(signum)`` runs on that thread. Main thread only."""

    def __init__(self, signals: tuple[signal.Signals, ...], on_signal: Callable[[int], None]):
        self.signals, self.on_signal = signals, on_signal
        self._read, self._write = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="ctj-signals", daemon=True)
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1

    def __enter__(self) -> SignalThread:
        self._write.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, _ignore)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return  # closed by __exit__
            for signum in data:
                if signum in self.signals:
                    self.on_signal(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self._write.close()  # the thread reads EOF and ends
        self._thread.join(5)
        self._read.close()


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler: nothing (the wakeup fd carries the signal to SignalThread);
    installed so that SIGTERM does not kill the process by default."""
