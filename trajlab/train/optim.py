"""AdamW for a model trained in bfloat16: float32 master weights and float32 moments, bfloat16 weights for compute.

AdamW stepping bfloat16 weights in place loses every update smaller than half a bfloat16 step of the weight it
changes: bfloat16 keeps 8 significant bits, so a weight of 0.02 moves in steps of 1.2e-4, and Adam's first updates
are about the learning rate, 1e-6 in real-model RL, which rounds to no change at all (tests/train/test_optim.py
measures it). :class:`MasterWeightAdamW` keeps a float32 copy of each low-precision weight, gives AdamW the
gradient in float32, steps the copy with float32 moments and writes it back rounded: the forward pass, the
gradients and generation stay in bfloat16, and small updates add up in the copy until they move the weight. It
costs 4 bytes per parameter for the copy, and the moments take 8 instead of 4.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` over float32 master copies of the low-precision parameters it is given (float32 ones
    are stepped as they are); the parameters themselves get the masters' values, rounded, after every step.

    Takes what ``AdamW`` takes (parameters or parameter groups, and its keyword arguments). ``state_dict`` holds the
    master copies too, so a resumed run continues from the unrounded weights.
    """

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(the model's parameter, its float32 master) for every low-precision parameter."""
        master_groups = []
        for group in groups:
            masters = []
            for param in group["params"]:
                if param.dtype == torch.float32:
                    masters.append(param)
                    continue
                master = param.detach().to(torch.float32).clone()
                self.pairs.append((param, master))
                masters.append(master)
            master_groups.append({**group, "params": masters})
        super().__init__(master_groups, **kwargs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step on the masters, from the parameters' gradients in float32; then the parameters get the
        masters' values (rounded to their dtype)."""
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.to(torch.float32)
        loss = super().step(closure)
        for param, master in self.pairs:
            param.copy_(master)
            master.grad = None  # the float32 gradient lives only for the step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients (the masters' exist only inside :meth:`step`)."""
        super().zero_grad(set_to_none)
        for param, _ in self.pairs:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["master_weights"] = [master for _, master in self.pairs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's state, and the saved masters copied into this optimizer's (and rounded into the parameters)."""
        state = dict(state_dict)
        masters = state.pop("master_weights", None)
        super().load_state_dict(state)
        if masters is None:
            return
        if len(masters) != len(self.pairs):
            raise ValueError(f"the optimizer state holds {len(masters)} master weights; this model has "
                             f"{len(self.pairs)} low-precision parameters: it is another model's state")
        with torch.no_grad():
            for (param, master), saved in zip(self.pairs, masters, strict=True):
                master.copy_(saved)
                param.copy_(master)


def needs_master_weights(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of the trainable ``params`` is stored below float32 (bfloat16: the only half type trained)."""
    return any(p.requires_grad and p.dtype != torch.float32 for p in params)


def adamw(params: list[torch.Tensor], *, master_weights: bool, **kwargs: Any) -> torch.optim.AdamW:
    """AdamW over ``params``: :class:`MasterWeightAdamW` when ``master_weights`` and some are bfloat16, else
    ``torch.optim.AdamW`` as it is (a float32 model trains exactly as before)."""
    if master_weights and needs_master_weights(params):
        return MasterWeightAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
