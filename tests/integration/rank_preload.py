"""What a forked rank finds imported: the forkserver of tests/integration/ranks.py imports
this module once, so each rank costs a fork (milliseconds) instead of importing torch,
DCP and the engine again (about 4 CPU-seconds a rank on these machines).

The forkserver must stay single-threaded for its forks to be safe: one BLAS or OpenMP
thread pool started at import would be copied without its threads. So the thread counts
are pinned before anything that reads them is imported (each rank sets its own after the
fork, from the environment the test gave it).
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - FSDP2 imports it: ~2 s a rank otherwise
import torch.distributed.checkpoint.state_dict  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401

import tests.integration.chaos_worker  # noqa: E402,F401
import tests.integration.workers  # noqa: E402,F401
import trainer_sidecar.load.restore  # noqa: E402,F401
import trainer_sidecar.save.protocol  # noqa: E402,F401
