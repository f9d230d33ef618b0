"""Padding-free batches (``rl.padding_free``, ``sft.padding_free``): rollouts packed into one row, each attending to
itself alone, give the padded computation's logprobs, loss and gradients, on the real tiny model."""

import json
import random

import pytest
import torch
from accelerate import Accelerator

import trajlab
from trajlab.config import RLSettings, SFTSettings
from trajlab.data.datasets import sft_dataset
from trajlab.models.loading import load_model
from trajlab.rollout.types import TokenRecord, Trajectory
from trajlab.train.batches import by_rollout, micro_batches, packed_batch, padded_batch
from trajlab.train.logprobs import batch_logprobs
from trajlab.train.loss import policy_loss
from trajlab.train.update import PolicyUpdate

from .test_sft import demonstrations

LENGTHS = [(12, 5), (40, 31), (9, 60), (25, 14), (70, 8)]  # (prompt, completion): tenfold apart


def varied(model, lengths=LENGTHS, seed=0):
    """Rollouts of random tokens at these lengths, a tool result (loss mask 0) in the middle of each completion,
    the model's own logprobs of its tokens; and advantages of both signs."""
    draw = random.Random(seed)
    rollouts, advantages = [], []
    for n, (prompt, completion) in enumerate(lengths):
        ids = [draw.randrange(5, 1500) for _ in range(prompt + completion)]
        mask = [0 if completion // 3 <= i < completion // 2 else 1 for i in range(completion)]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        full = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[1:, None]).squeeze(-1)
        logprobs = [full[prompt - 1 + i].item() if bit else None for i, bit in enumerate(mask)]
        tokens = TokenRecord(prompt_ids=ids[:prompt], completion_ids=ids[prompt:], loss_mask=mask, logprobs=logprobs)
        rollouts.append(Trajectory(id=f"t{n}", env="arithmetic", task={}, messages=[], tools=[], reward=1.0,
                                   status="success", tokens=tokens))
        advantages.append([(-1) ** n * 0.5 * bit for bit in mask])
    return rollouts, advantages


def test_a_packed_row_gives_each_rollout_the_logprobs_it_has_alone(tiny_model_dir):
    model = load_model(tiny_model_dir)
    rollouts, advantages = varied(model)
    chosen = list(range(len(rollouts)))
    results = {}
    for name, batch in (("padded", padded_batch(rollouts, advantages, 0, torch.device("cpu"))),
                        ("packed", packed_batch(rollouts, advantages, torch.device("cpu")))):
        with torch.no_grad():
            results[name] = by_rollout(batch_logprobs(model, batch, 1.0)[0], batch, chosen, rollouts)
    packed = packed_batch(rollouts, advantages, torch.device("cpu"))
    assert packed["input_ids"].shape == (1, sum(p + c for p, c in LENGTHS)), "no padding"
    for i, rollout in enumerate(rollouts):
        for mine, padded, own in zip(results["packed"][i], results["padded"][i], rollout.tokens.logprobs,
                                     strict=True):
            assert mine == pytest.approx(padded, abs=1e-5)
            if own is not None:  # the rollout run by itself, as varied() computed it
                assert mine == pytest.approx(own, abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("corrected", [False, True], ids=["on-policy", "corrected"])
def test_the_packed_loss_and_gradients_equal_the_padded_ones(tiny_model_dir, estimator, corrected):
    """Every estimator, with a KL term to a reference and, when another engine sampled, the truncated importance
    weight: the same loss to 1e-5 and the same gradients to 1e-12. The models run in float64: in float32 the two
    layouts sum in different orders, and on some CPUs a few of 2.5M gradients then differ by 2.6e-6 (seen on an AMD
    EPYC host), which says nothing about packing; in float64 they agree to 7e-16."""
    settings = RLSettings(estimator=estimator, kl_coef=0.1)
    rollouts, advantages = varied(load_model(tiny_model_dir))
    reference = load_model(tiny_model_dir).double()
    with torch.no_grad():  # a starting policy the trained one has moved away from
        reference.model.norm.weight.mul_(0.9)
    trainer = [[(lp or 0.0) + 0.01 for lp in t.tokens.logprobs] for t in rollouts] if corrected else None
    results = []
    for batch in (padded_batch(rollouts, advantages, 0, torch.device("cpu"), trainer),
                  packed_batch(rollouts, advantages, torch.device("cpu"), trainer)):
        model = load_model(tiny_model_dir).double().train()
        stats = policy_loss(model, reference, batch, settings, normaliser=float(len(rollouts)))
        stats["loss_tensor"].backward()
        results.append((stats, torch.cat([p.grad.flatten() for p in model.parameters()])))
    (padded, padded_grad), (packed, packed_grad) = results
    for key in ("loss", "kl", "entropy", "clip_fraction"):
        assert packed[key] == pytest.approx(padded[key], abs=1e-5), key
    assert padded_grad.abs().sum() > 0 and padded["kl"] > 0
    assert torch.allclose(packed_grad, padded_grad, atol=1e-12, rtol=1e-9)


def test_packed_micro_batches_count_the_tokens_they_hold():
    """Padded, three rollouts of 10, 10 and 100 tokens take 300 (every row as long as the longest); packed, 120."""
    lengths = {0: 10, 1: 10, 2: 100}
    assert micro_batches([0, 1, 2], lengths, 8, 150) == [[0, 1], [2]]
    assert micro_batches([0, 1, 2], lengths, 8, 150, packed=True) == [[0, 1, 2]]
    assert micro_batches([0, 1, 2], lengths, 8, 100, packed=True) == [[0, 1], [2]]


def test_a_padding_free_rl_update_ends_where_the_padded_one_does(tiny_model_dir, tiny_tokenizer):
    """Two minibatches of micro-batches of two, the trainer's logprobs recomputed first: the same statistics, the
    same trainer logprobs and the same weights after the optimizer steps."""
    outcomes = []
    for padding_free in (False, True):
        model = load_model(tiny_model_dir).train()
        rollouts, advantages = varied(load_model(tiny_model_dir))
        settings = RLSettings(padding_free=padding_free, micro_batch_size=2, minibatch_size=3, learning_rate=1e-3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        update = PolicyUpdate(model, None, optimizer, scheduler, Accelerator(cpu=True), settings, 100, 0)
        stats, logprobs = update(rollouts, advantages, correct=True, shuffle_seed=3)
        outcomes.append((stats, logprobs, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (padded, padded_lps, padded_weights), (packed, packed_lps, packed_weights) = outcomes
    for key in ("loss", "grad_norm", "entropy", "mismatch/abs_logprob"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert sorted(packed_lps) == sorted(padded_lps) == list(range(len(LENGTHS)))
    for index, lps in padded_lps.items():
        assert packed_lps[index] == pytest.approx(lps, abs=1e-5)
    start = torch.cat([p.flatten() for p in load_model(tiny_model_dir).parameters()])
    moved = (padded_weights - start).norm()
    assert moved > 0 and (packed_weights - padded_weights).norm() / moved < 1e-3


def test_padding_free_sft_trains_as_padded_sft(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path):
    """TRL's padding-free collator (one row, position ids restarting) under trajlab's sliced loss: the same losses
    and weights as padded batches of the same demonstrations. In float64: in float32 the two batch shapes' summation
    orders alone moved the weights apart by 4e-5 to 1.5e-4 of their movement from run to run on one host (AdamW
    divides each gradient by its own size, so near-zero gradients carry that noise into whole steps); in float64 the
    two runs agree to the bit here, and the bound below leaves room only for another host's summation order."""
    dataset = sft_dataset(demonstrations(tiny_tokenizer, tiny_template), include_failures=False,
                          shortest_per_task=False)
    finals, logs = [], []
    for padding_free in (False, True):
        settings = SFTSettings(max_steps=2, batch_size=4, logging_steps=1, warmup_steps=0, padding_free=padding_free)
        out = tmp_path / str(padding_free)
        model = load_model(tiny_model_dir, dtype=torch.float64)
        finals.append(trajlab.sft(model, dataset, out, tokenizer=tiny_tokenizer, **settings.model_dump()))
        logs.append([line for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss/sft"' in line])
    padded, packed = ([json.loads(line) for line in rows] for rows in logs)
    assert len(padded) == len(packed) == 2
    for one, other in zip(padded, packed, strict=True):
        assert other["loss/sft"] == pytest.approx(one["loss/sft"], rel=1e-5)
    assert all(json.loads((final / "config.json").read_text())["dtype"] == "float64" for final in finals)
    start, padded_weights, packed_weights = (
        torch.cat([p.flatten() for p in load_model(path, dtype=torch.float64).parameters()])
        for path in (tiny_model_dir, *finals))
    moved = (padded_weights - start).norm()
    assert moved > 0 and (packed_weights - padded_weights).norm() / moved < 1e-9
