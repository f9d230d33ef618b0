"""Handing the trained weights to what samples the rollouts.

The ``hf`` backend in the synchronous loop samples from the very model being trained: nothing to hand over. A sampler
with weights of its own (an in-process vLLM engine, Ray rollout workers: :class:`TakesWeights`) gets them after the
update, and frees its memory during it; asynchronous RL with the ``hf`` backend samples from a copy of the policy
(the behaviour policy), which takes the weights between two steps' rollouts. Under sharded training every process
takes part in gathering the weights (:class:`WholeCopy`, :class:`GatherOnly`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trajlab.inference.base import TakesWeights
from trajlab.inference.weights import full_weights


@contextmanager
def synced_sampler(sampler: Any, model: torch.nn.Module) -> Iterator[None]:
    """Around the synchronous update: a sampler with weights of its own frees its memory (sleep), then wakes and
    takes the new weights, so the next rollouts come from them. Nothing for the on-policy ``HFGenerator``."""
    if not isinstance(sampler, TakesWeights):
        yield
        return
    sampler.sleep()
    try:
        yield
    finally:
        sampler.wake_up()
    sampler.load_weights(model)


def publish(sampler: Any, behaviour: torch.nn.Module | None, model: torch.nn.Module) -> None:
    """Hand the trained weights to what samples: its own copy (vLLM, rollout workers), or the behaviour policy."""
    if isinstance(sampler, TakesWeights):
        sampler.load_weights(model)
    elif behaviour is not None:
        with torch.no_grad():
            for mine, trained in zip(behaviour.parameters(), model.parameters(), strict=True):
                mine.copy_(trained)


class WholeCopy:
    """The ``hf`` backend's sampler under sharded training (``rl.sharding: fsdp``): generation runs on a whole copy
    of the policy in each process (a sharded model would gather every layer for every generated token, in lockstep
    with the other processes), which takes the trained weights, gathered a layer at a time, after every update.

    Args:
        generator: the ``HFGenerator`` over ``copy``.
        copy: the whole model it samples from (a plain model: LoRA arrives merged).
    """

    def __init__(self, generator: Any, copy: torch.nn.Module) -> None:
        self.generator, self.copy = generator, copy

    @property
    def batches(self) -> int:
        """The generator's calls so far (the loop's ``generate_calls``)."""
        return self.generator.batches

    def load_weights(self, model: torch.nn.Module) -> None:
        mine = self.copy.state_dict()
        with torch.no_grad():
            for name, tensor in full_weights(model):
                mine[name].copy_(tensor)

    def sleep(self) -> None:
        """Nothing: the copy is small next to what it saves (the sharded policy never gathers to generate)."""

    def wake_up(self) -> None:
        """Nothing (see :meth:`sleep`)."""


class GatherOnly:
    """A trainer process without a sampler of its own under sharded training (not the main process, with rollout
    workers): gathering the weights for the main process's sampler takes every process, so it takes part and keeps
    nothing."""

    def load_weights(self, model: torch.nn.Module) -> None:
        for _ in full_weights(model):
            pass

    def sleep(self) -> None:
        """Nothing to free."""

    def wake_up(self) -> None:
        """Nothing (see :meth:`sleep`)."""
