"""One RL step's optimizer steps over its rollouts: minibatches of micro-batches, dealt to the trainer processes.

Every process holds all of the step's rollouts. Each minibatch's micro-batches are dealt round-robin to the
processes; a process with none left runs a pass of weight zero, so all run the same number of backward passes (DDP
all-reduces on each, FSDP reduce-scatters) and nobody waits forever. Losses are scaled by the process count, since
both average gradients: the sum over processes is the single-process gradient.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from trajlab.config import RLSettings
from trajlab.models.devices import release_freed_memory
from trajlab.rollout.types import Trajectory
from trajlab.train.batches import by_rollout, micro_batches, packed_batch, padded_batch, rollout_lengths
from trajlab.train.logprobs import batch_logprobs, unwrap
from trajlab.train.loss import loss_normaliser, policy_loss
from trajlab.train.mismatch import MismatchSums
from trajlab.train.schedule import optimizer_steps
from trajlab.train.sharding import grad_norm as sharded_grad_norm
from trajlab.train.sharding import is_sharded

LOSS_STATS = ("loss", "kl", "entropy", "clip_fraction")


@dataclass
class PolicyUpdate:
    """The trained policy with what updates it; calling it runs one RL step's optimizer steps.

    Args:
        policy: the policy as accelerate prepared it (DDP-wrapped under several processes), or sharded
            (:func:`trajlab.train.sharding.shard`); a PEFT model with LoRA.
        reference: the frozen starting policy of the KL term (None: no KL, or LoRA's disabled adapter).
        token_budget: the most model tokens an episode can have (Dr.GRPO's constant normaliser).
        pad_id: the padding token (padding is marked by the attention mask, never by this id).
        processor: a vision-language model's, for rollouts with images.
    """

    policy: torch.nn.Module
    reference: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    accelerator: Accelerator
    settings: RLSettings
    token_budget: int
    pad_id: int
    processor: Any = None

    def __call__(self, trajectories: list[Trajectory], token_advantages: list[list[float]], *, correct: bool,
                 shuffle_seed: int, rate_scale: float = 1.0) -> tuple[dict[str, float], dict[int, list[float]]]:
        """The step's optimizer steps; returns its loss statistics with the sampler-trainer mismatch
        (``mismatch/...``), and the trainer's logprobs of each rollout's completion tokens (by index) as they were
        before the first optimizer step, for the rollouts this process computed them for.

        ``correct``: the sampler was not this model's own forward pass, so the trainer's logprobs are recomputed first
        for every rollout that trains (the "old" policy of the clipped ratio) and each token's loss is weighted by the
        truncated importance weight. Without it the mismatch is measured on the passes before the first optimizer
        step; either way on the rollouts that train. ``shuffle_seed`` orders the minibatches; ``rate_scale``
        multiplies the scheduled rate of this step's optimizer steps.
        """
        usable = [i for i, t in enumerate(trajectories) if t.tokens is not None and any(t.tokens.loss_mask)]
        if not usable:  # the step's planned optimizer steps pass at rate 0: the schedule stays on the run's plan
            self._skip_optimizer_steps(optimizer_steps(self.settings))
            return _nothing_trained(), {}
        if rate_scale == 0:  # no weight would move: skip the passes and the optimizer, keep the schedule's count
            self._skip_optimizer_steps(optimizer_steps(self.settings, len(usable)))
            return _nothing_trained(), {}
        lengths = rollout_lengths(trajectories, usable)
        # A rollout whose advantage is zero on every token (e.g. a group that all succeeded) adds nothing to the
        # gradient without a KL term: skip its forward and backward (and its recomputed logprobs). Normalisers still
        # count it: the same step.
        silent = {i for i in usable if not any(token_advantages[i])} if self.settings.kl_coef == 0 else set()
        mismatch = MismatchSums()
        trained = sorted((i for i in usable if i not in silent), key=lengths.__getitem__)
        trainer_logprobs = self.trainer_logprobs(trajectories, trained, lengths, mismatch) if correct else {}
        if not correct and optimizer_steps(self.settings, len(usable)) > 1:  # later steps need the "old" logprobs
            self._own_logprobs_first(trajectories, trained, lengths)
        totals, passes, steps, grad_norm = dict.fromkeys(LOSS_STATS, 0.0), 0, 0, 0.0
        for minibatch in self._minibatches(usable, lengths, shuffle_seed):
            normaliser = loss_normaliser([trajectories[i] for i in minibatch], self.settings.estimator,
                                         self.token_budget)
            for chosen, weight in self._dealt([i for i in minibatch if i not in silent], lengths):
                batch = self._batch([trajectories[i] for i in chosen], [token_advantages[i] for i in chosen],
                                    [trainer_logprobs[i] for i in chosen] if correct else None)
                stats = policy_loss(self.policy, self.reference, batch, self.settings, normaliser, self.processor)
                self.accelerator.backward(stats.pop("loss_tensor") * (weight * self.accelerator.num_processes))
                release_freed_memory()  # the pass's activations and slices, freed but kept by the C heap
                if not weight:  # a pass that only keeps the processes in step
                    continue
                if not correct and steps == 0:  # the weights that sampled: the mismatch is the engines' difference
                    mismatch.add(stats["trainer_logprobs"], batch, self.settings.importance_cap)
                    trainer_logprobs |= by_rollout(stats["trainer_logprobs"], batch, chosen, trajectories)
                for key in totals:
                    totals[key] += stats[key]
                passes += 1
            grad_norm += self._optimizer_step(rate_scale)
            steps += 1
        totals, passes, mismatch = self._summed(totals, passes, mismatch)
        # Micro-batch losses add up to their minibatch's loss; the other statistics are averages over passes.
        averages = {key: value / max(1, passes) for key, value in totals.items()}
        return (averages | {"loss": totals["loss"] / max(1, steps), "grad_norm": grad_norm / max(1, steps),
                            "trained_sequences": len(usable) - len(silent)} | mismatch.means()), trainer_logprobs

    def _own_logprobs_first(self, trajectories: list[Trajectory], trained: list[int], lengths: dict[int, int]) -> None:
        """Give the trained rollouts that no sampler made (:data:`~trajlab.train.loss.OWN_LOGPROB`, replayed
        demonstrations) the model's own logprobs before the first optimizer step, as their "old" policy of every step;
        with one optimizer step the loss takes them from its own pass instead, at no extra pass."""
        own = [i for i in trained if any(math.isnan(lp) for lp in trajectories[i].tokens.logprobs if lp is not None)]
        for index, logprobs in self.trainer_logprobs(trajectories, own, lengths, MismatchSums()).items():
            trajectories[index].tokens.logprobs = logprobs

    def _minibatches(self, usable: list[int], lengths: dict[int, int], shuffle_seed: int) -> list[list[int]]:
        """``epochs_per_step`` shuffled passes over the rollouts, cut into minibatches (one optimizer step each)
        whose rollouts are sorted by length, so their micro-batches waste little on padding."""
        per_step = self.settings.minibatch_size or len(usable)
        shuffle = torch.Generator().manual_seed(shuffle_seed)
        minibatches = []
        for _ in range(self.settings.epochs_per_step):
            order = [usable[i] for i in torch.randperm(len(usable), generator=shuffle).tolist()]
            minibatches += [sorted(order[start : start + per_step], key=lengths.__getitem__)
                            for start in range(0, len(order), per_step)]
        return minibatches

    def _dealt(self, trained: list[int], lengths: dict[int, int]) -> list[tuple[list[int], float]]:
        """This process's micro-batches of a minibatch (round-robin), each with its weight: 0 for a stand-in pass
        where the process has none left while others still do."""
        processes = self.accelerator.num_processes
        micro = micro_batches(trained, lengths, self.settings.micro_batch_size, self.settings.micro_batch_tokens,
                              packed=self.settings.padding_free)
        dealt = []
        for turn in range(math.ceil(len(micro) / processes)):
            index = turn * processes + self.accelerator.process_index
            dealt.append((micro[index], 1.0) if index < len(micro) else (micro[0], 0.0))
        return dealt

    def _batch(self, rows: list[Trajectory], advantages: list[list[float]],
               trainer_logprobs: list[list[float]] | None = None) -> dict[str, Any]:
        """A micro-batch's tensors: packed into one row with ``padding_free`` (rollouts with images excepted), else
        right-padded."""
        if self.settings.padding_free and not any(t.images for t in rows):
            return packed_batch(rows, advantages, self.accelerator.device, trainer_logprobs)
        return padded_batch(rows, advantages, self.pad_id, self.accelerator.device, trainer_logprobs)

    def _optimizer_step(self, rate_scale: float) -> float:
        """Clip, step at the scheduled rate times ``rate_scale``, schedule; returns the gradient norm before
        clipping."""
        if is_sharded(self.policy):
            grad_norm = sharded_grad_norm(self.policy, self.settings.max_grad_norm)
        else:
            grad_norm = float(self.accelerator.clip_grad_norm_(self.policy.parameters(), self.settings.max_grad_norm))
        for group, rate in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = rate * rate_scale  # the scheduler's next step sets the unscaled rate again
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return grad_norm

    def _skip_optimizer_steps(self, count: int) -> None:
        """Advance the schedule by ``count`` optimizer steps that do not run (a step at rate 0): the weights and the
        optimizer's moments stay as they are, and the next step's rate is the one it would have had."""
        with warnings.catch_warnings():  # torch warns of a scheduler step before any optimizer step: meant here
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            for _ in range(count):
                self.scheduler.step()

    def _summed(self, totals: dict[str, float], passes: int,
                mismatch: MismatchSums) -> tuple[dict[str, float], int, MismatchSums]:
        """The statistics of every process's passes (this process's alone when there is one)."""
        if self.accelerator.num_processes == 1:
            return totals, passes, mismatch
        summed = self.accelerator.reduce(torch.tensor([*totals.values(), float(passes), *mismatch.sums()],
                                                      device=self.accelerator.device), reduction="sum").tolist()
        return (dict(zip(totals, summed[: len(totals)], strict=True)), int(summed[len(totals)]),
                MismatchSums(*summed[len(totals) + 1 :]))

    @torch.no_grad()
    def trainer_logprobs(self, trajectories: list[Trajectory], order: list[int], lengths: dict[int, int],
                         mismatch: MismatchSums) -> dict[int, list[float]]:
        """The trained model's logprob of every completion token of each rollout, before any optimizer step: the
        "old" policy of the clipped ratio when another engine sampled. Eval mode, as sampling ran; micro-batches of
        similar lengths, cut as the update cuts them (``lengths``: :func:`rollout_lengths` of at least ``order``)."""
        model = unwrap(self.policy)
        training = model.training
        model.eval()
        out: dict[int, list[float]] = {}
        try:
            for chosen in micro_batches(order, lengths, self.settings.micro_batch_size,
                                        self.settings.micro_batch_tokens, packed=self.settings.padding_free):
                rows = [trajectories[i] for i in chosen]
                batch = self._batch(rows, [[0.0] * len(t.tokens.completion_ids) for t in rows])
                logprobs, _ = batch_logprobs(model, batch, self.settings.temperature, self.processor)
                mismatch.add(logprobs, batch, self.settings.importance_cap)
                out |= by_rollout(logprobs, batch, chosen, trajectories)
        finally:
            model.train(training)
        return out


def _nothing_trained() -> dict[str, float]:
    """The statistics of an update that trained nothing."""
    return dict.fromkeys((*LOSS_STATS, "grad_norm"), 0.0) | {"trained_sequences": 0}
