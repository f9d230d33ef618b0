"""Handing the trained weights to what samples the rollouts.

The ``hf`` backend in the synchronous loop samples from the very model being trained: nothing to hand over. A sampler
with weights of its own (an in-process vLLM engine, Ray rollout workers: :class:`TakesWeights`) gets them after the
update, and frees its memory during it; asynchronous RL with the ``hf`` backend samples from a copy of the policy
(the behaviour policy), which takes the weights between two steps' rollouts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trajlab.inference.base import TakesWeights


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
