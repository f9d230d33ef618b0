"""The sampler-trainer mismatch: token sums over model tokens only, that add up across processes."""

import math

import pytest
import torch

from trajlab.train.mismatch import MismatchSums


def batch(sampler: list[list[float]], mask: list[list[int]], start: int) -> dict:
    """A batch whose completions start at ``start``: the sampler's logprobs and the loss mask, prompt zeros before."""
    pad = [[0.0] * start for _ in sampler]
    return {"completion_start": start, "old_logprobs": torch.tensor([p + s for p, s in zip(pad, sampler, strict=True)]),
            "loss_mask": torch.tensor([p + m for p, m in zip(pad, mask, strict=True)], dtype=torch.float32)}


def test_the_mismatch_of_each_model_token_and_none_of_the_others():
    sampled = batch([[-1.0, -2.0, -0.5], [-1.0, -3.0, 0.0]], [[1, 1, 0], [1, 0, 0]], start=2)
    trainer = torch.tensor([[-1.0, -1.0, -9.0], [-2.0, -9.0, -9.0]])  # -9: tokens that are not the model's
    sums = MismatchSums()
    sums.add(trainer, sampled, cap=2.0)
    deltas = [0.0, 1.0, -1.0]  # trainer - sampler, model tokens only
    assert sums.tokens == 3
    means = sums.means()
    assert means["mismatch/abs_logprob"] == pytest.approx(2 / 3)
    assert means["mismatch/kl"] == pytest.approx(sum(math.exp(d) - d - 1 for d in deltas) / 3)
    assert means["mismatch/clipped_share"] == pytest.approx(1 / 3), "exp(1) > 2: one weight over the cap"


def test_sums_add_up_across_processes_and_an_empty_step_logs_nothing():
    first, second = MismatchSums(), MismatchSums()
    first.add(torch.tensor([[-1.0]]), batch([[-2.0]], [[1]], start=0), cap=2.0)
    second.add(torch.tensor([[-3.0, -1.0]]), batch([[-3.0, -1.5]], [[1, 1]], start=0), cap=2.0)
    reduced = MismatchSums(*[a + b for a, b in zip(first.sums(), second.sums(), strict=True)])
    assert reduced.tokens == 3 and reduced.means()["mismatch/abs_logprob"] == pytest.approx((1 + 0 + 0.5) / 3)
    masked = MismatchSums()
    masked.add(torch.tensor([[0.0]]), batch([[-5.0]], [[0]], start=0), cap=2.0)  # no model token: nothing counted
    assert masked.tokens == 0 and masked.means() == {} and MismatchSums().means() == {}
