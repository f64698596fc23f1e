"""The DCP state dict a save writes and a load fills: model, optimizer, extra values."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict


def build_state(model: torch.nn.Module, optimizer: Any, extra: dict[str, Any] | None) -> dict:
    """The DCP state dict: model, optimizer (FQN-keyed, sharded as the model is), extra."""
    optimizers = [] if optimizer is None else [optimizer]
    model_sd, optim_sd = get_state_dict(model, optimizers)
    state: dict[str, Any] = {"model": model_sd, "extra": dict(extra or {})}
    if optimizer is not None:
        state["optim"] = optim_sd
    return state
