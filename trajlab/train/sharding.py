"""Sharded training (``rl.sharding`` / ``sft.sharding: fsdp``): every trainer process holds a slice of each weight,
its gradient and its AdamW moments, instead of all of them (plain data parallelism).

PyTorch's FSDP2 (``fully_shard``) directly, not accelerate's FSDP plugin: accelerate turns FSDP on only for
accelerator devices, so processes on CPUs (gloo) would silently train data-parallel and nothing here could be tested
where it runs; ``fully_shard`` runs the same on gloo and NCCL. Each decoder layer is one shard group (gathered for
its forward and backward pass, then freed), the rest (embeddings, final norm, output head) is the root group.
Checkpoints are PyTorch distributed checkpoints: each process writes and reads its own slices.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from trajlab.inference.weights import full_weights

logger = logging.getLogger(__name__)
SHARDED_STATE = "sharded"
"""The folder, inside a checkpoint, of the model's and optimizer's slices (one file per process)."""


def shard(model: torch.nn.Module, *, compute_dtype: torch.dtype | None) -> torch.nn.Module:
    """``model`` sharded over the processes of the default process group, layer by layer, in place.

    ``compute_dtype``: the forward and backward passes run in it (bfloat16) while the sharded weights, and so AdamW's
    update, stay in their own dtype (float32 master weights); gradients are reduced in float32. None: computed in
    the weights' dtype.

    Raises:
        ValueError: the model names no decoder layer class (``_no_split_modules``) to shard by.
    """
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"{type(base).__name__} names no decoder layer class (_no_split_modules) to shard by.")
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was sharded by :func:`shard`."""
    return isinstance(model, FSDPModule)


def grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the sharded gradients to ``max_norm`` (the norm over every process's slices); the norm before it."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Each process writes its slices of the weights and AdamW's state to ``checkpoint/sharded``."""
    weights, moments = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optimizer": moments}, checkpoint_id=str(checkpoint / SHARDED_STATE))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Each process reads its slices from ``checkpoint/sharded`` into ``model`` and ``optimizer``.

    Raises:
        FileNotFoundError: the checkpoint was not written by a sharded run.
    """
    if not (checkpoint / SHARDED_STATE).is_dir():
        raise FileNotFoundError(f"{checkpoint} holds no sharded state ({SHARDED_STATE}/): it was written by a run "
                                "without sharding: fsdp; resume it with the sharding it was trained with.")
    weights, moments = get_state_dict(model, optimizer)
    state = {"model": weights, "optimizer": moments}
    dcp.load(state, checkpoint_id=str(checkpoint / SHARDED_STATE))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def gathered_state(model: torch.nn.Module, *, keep: bool) -> dict[str, torch.Tensor] | None:
    """The whole model's weights (LoRA merged) in host memory, gathered a shard group at a time: kept by the process
    with ``keep`` (the one that writes them), passed over by the others (every process must take part)."""
    weights = {}
    for name, tensor in full_weights(model):
        if keep:
            weights[name] = tensor.to("cpu")
    return weights if keep else None
