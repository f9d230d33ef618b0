"""A trained model's weights as a sampler loads them: named as the base checkpoint names them, LoRA merged in, and,
for a model sharded over several processes (FSDP2), gathered one shard group (one decoder layer) at a time.

Every sampler that takes weights (an in-process vLLM engine, a ``vllm serve`` process, Ray rollout workers, the
``hf`` backend's behaviour copy) reads them through :func:`full_weights`, so none of them needs to know how the
trainer holds its parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every weight of ``model`` as the base checkpoint names it; a PEFT model's active LoRA
    adapters are merged into their base weights on the fly (the model itself is left as it is).

    A model sharded with FSDP2 (:func:`trajlab.train.sharding.shard`) is gathered one shard group at a time: each
    group's full weights exist only while its tensors are yielded (as copies, so they outlive the group's
    re-sharding), never the whole model at once. Gathering is collective: every process must consume the whole
    iterator, in the same order, or the others wait for it.
    """
    lora = hasattr(model, "peft_config")
    base = model.get_base_model() if lora else model
    if not isinstance(model, FSDPModule):
        yield from _merged(base, lambda name: True, lora)
        return
    groups = [(name, module) for name, module in base.named_modules()
              if isinstance(module, FSDPModule) and module is not model and name]
    nested = tuple(f"{name}." for name, _ in groups)
    with _unsharded(model):  # the root group's own weights (embeddings, final norm, output head)
        for name, tensor in _merged(base, lambda key: not key.startswith(nested), lora, sharded=True):
            yield name, tensor.clone()
    for prefix, module in groups:
        with _unsharded(module):
            for name, tensor in _merged(module, lambda key: True, lora, sharded=True):
                yield f"{prefix}.{name}", tensor.clone()


def _merged(module: torch.nn.Module, keep: Callable[[str], bool], lora: bool,
            sharded: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of ``module``'s state dict whose keys ``keep`` accepts; with ``lora``, LoRA's deltas added to their
    base weights and LoRA's own tensors left out (names as the base checkpoint has them). ``sharded``: read from the
    modules as they hold them now (:func:`_registered`)."""
    deltas = {}
    if lora:
        from peft.tuners.lora import LoraLayer
    for name, layer in module.named_modules() if lora else ():
        if isinstance(layer, LoraLayer) and not layer.merged and not layer.disable_adapters and keep(name):
            with torch.no_grad():
                deltas[f"{name}.weight"] = sum(layer.get_delta_weight(a) for a in layer.active_adapters
                                               if a in layer.lora_A)
    for key, tensor in _registered(module) if sharded else module.state_dict().items():
        if ".lora_" in key or not keep(key):
            continue
        name = key.replace(".base_layer.", ".")
        delta = deltas.get(name)
        yield name, tensor.detach() + delta if isinstance(delta, torch.Tensor) else tensor.detach()


def _registered(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``module.state_dict()`` holds (parameters, tied ones under each name, and persistent buffers) as the
    modules hold them now: an FSDP2 module's state dict would re-shard it first."""
    yield from module.named_parameters(remove_duplicate=False)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buffer


@contextmanager
def _unsharded(module: Any) -> Iterator[None]:
    """Inside the block, an FSDP2 module's own parameters are whole (gathered from every process)."""
    module.unshard()
    try:
        yield
    finally:
        module.reshard()
