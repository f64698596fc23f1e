"""Ending a rank process once its work is done, without the abort torch's gloo threads cause.

torch (2.15) keeps a gloo process group's C++ objects, and so its worker threads
(``pt_gloo_runloop``), alive past ``destroy_process_group()``: something on the C++ side
still holds the group after an FSDP2 job (measured: the threads outlive destroy, a
``del`` of the model, ``gc.collect()`` and a cleared DTensor sharding cache). A worker
thread that drops its last work (tensors with Python owners) while the interpreter
finalizes needs the GIL there, and CPython 3.11 ends such a thread with pthread_exit
through a noexcept frame: "terminate called without an active exception", SIGABRT. The
rank's work was done, yet its pod is Failed. It happens more often the busier the
machine (2 of ~100 rank exits in a test run on 2 cores; compare pytorch/pytorch#179291,
an atexit destroy proposed upstream and abandoned).

``exit_rank`` does what a normal exit does first (atexit handlers, so a Checkpointer not
closed yet is closed and its save finished), destroys the process group, flushes, and
ends the process with ``os._exit``: no interpreter finalization, so no abort.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist


def exit_rank(code: int = 0) -> NoReturn:
    """End this rank process now with ``code``, after its atexit handlers and with its
    process group destroyed; call it where the script would return from ``main``."""
    atexit._run_exitfuncs()  # Checkpointer.close() among them: a staged save commits
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more to say
            pass
    os._exit(code)
