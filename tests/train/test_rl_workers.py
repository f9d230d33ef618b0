"""RL with rollout workers on a real local Ray cluster, against the same run in-process.

A module of its own: the rollout worker tests hold their cluster's CPUs for their whole module.
"""

from __future__ import annotations

import json

import pytest
import torch

from trajlab.chat.template import resolve_chat_template
from trajlab.config import RLSettings, RolloutSettings
from trajlab.models import load_model, load_tokenizer
from trajlab.train.rl import run_rl

from ..rollout.length_env import SPEC as LENGTH

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def terse_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its end-of-turn logit raised (about 6 above the others' near-zero logits), so its answers
    end after a few tokens, at lengths that differ from sample to sample (the untrained model almost never stops:
    its distribution is near uniform over 1,536 tokens)."""
    model, tokenizer = load_model(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about rain."}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.lm_head.weight[end] = hidden / hidden.norm() ** 2 * 6.0
    path = tmp_path_factory.mktemp("terse") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_rl_with_two_workers_learns_as_in_process(terse_model_dir, tmp_path):
    """Two RL steps: the workers sample what the in-process engine samples (seeded per episode and turn), take the
    trainer's weights after the first step, and the update ends at the same weights."""
    tiny_model_dir = terse_model_dir
    tokenizer = load_tokenizer(tiny_model_dir)
    settings = RLSettings(steps=2, tasks_per_step=2, group_size=4, learning_rate=1e-3, temperature=1.0,
                          rewards={"env": 1.0}, importance_sampling="on")
    # "on" in both runs: with workers (another sampler) auto would turn it on, in-process off, and Adam magnifies
    # the resulting difference of ~1e-7 in gradients this small (no signal means no scale) into visible weight noise
    finals, steps = [], []
    for name, workers in (("in_process", 0), ("workers", 2)):
        rollout = RolloutSettings(max_turns=1, max_new_tokens=48, concurrency=8, workers=workers)
        out = tmp_path / name
        finals.append(load_model(run_rl(tiny_model_dir, tokenizer, resolve_chat_template(tokenizer),
                                        LENGTH, settings, rollout, out, device="cpu")))
        steps.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    for local, remote in zip(*steps, strict=True):
        assert remote["reward"] == local["reward"] and remote["mean_turns"] == local["mean_turns"]
        assert remote["mismatch/abs_logprob"] < 1e-4, "the workers sampled from the trainer's weights"
    trained = [[step["trained_sequences"] for step in run] for run in steps]
    assert trained[0] == trained[1] and sum(trained[0]) > 0, "the same rollouts trained, and a real update"
    # Adam's first step moves each weight by about the learning rate whatever the gradient's scale; the two runs'
    # sampler logprobs differ by ~1e-7 (two processes), which moves weights whose gradient is near Adam's eps.
    start = load_model(terse_model_dir).state_dict()
    moved = max((w - start[n]).abs().max().item() for n, w in finals[0].state_dict().items())
    apart = max((a - b).abs().max().item() for a, b in zip(finals[0].state_dict().values(),
                                                           finals[1].state_dict().values(), strict=True))
    assert moved > 0.5 * settings.learning_rate and apart < 0.1 * settings.learning_rate, (moved, apart)
