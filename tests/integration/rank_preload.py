"""What a forked rank finds imported: the forkserver of tests/integration/ranks.py imports
this module once, so each rank costs a fork (milliseconds) instead of importing torch,
DCP and the engine again (about 4 CPU-seconds a rank on these machines).

The forkserver starts with one thread per pool (ctj_devcluster/forked.py says why);
each rank sets its own count after the fork, from the environment the test gave it.
"""

from __future__ import annotations

import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - FSDP2 imports it: ~2 s a rank otherwise
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401

import tests.integration.chaos_worker  # noqa: F401
import tests.integration.workers  # noqa: F401
import trainer_sidecar.load.restore  # noqa: F401
import trainer_sidecar.save.protocol  # noqa: F401
