"""Where training runs and in what precision: ``model.device`` / ``model.dtype`` for SFT and RL.

accelerate places training (TRL's trainer goes through it too): one process uses the current GPU, and under
``accelerate launch`` each process gets its own. So ``cuda:N`` makes GPU N the current one before accelerate starts,
and is refused where the launcher assigns GPUs itself.
"""

from __future__ import annotations

import os

import torch

from trajlab.errors import UserError
from trajlab.models.devices import resolve_device


def training_device(name: str | torch.device) -> torch.device:
    """The device ``name`` resolves to, made the one accelerate trains on.

    Raises:
        UserError: see :func:`trajlab.models.devices.resolve_device`; or ``cuda:N`` under a launch of several processes.
    """
    device = resolve_device(name)
    if device.type == "cuda" and device.index is not None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError(f"device {str(name)!r} picks one GPU, but this run has several processes (accelerate "
                            "launch), each given its own GPU: use --device auto or cuda")
        torch.cuda.set_device(device)
    return device


def check_trainable(model: torch.nn.Module) -> None:
    """Refuse float16 weights: training them without loss scaling under- and overflows; bfloat16 has the range.

    Raises:
        UserError: the model's weights are float16.
    """
    if next(model.parameters()).dtype == torch.float16:
        raise UserError("float16 weights cannot be trained here (no loss scaling for pure half precision): use "
                        "--dtype bfloat16, or float32 (on a GPU with bfloat16, SFT then computes in bfloat16 autocast)")
