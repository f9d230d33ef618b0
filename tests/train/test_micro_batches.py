"""RL micro-batches bounded by tokens as well as rollouts: how rollouts are cut, and that the cut changes memory only,
never the update."""

import torch

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.data.store import read_trajectories
from trajlab.env import load_env
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.train.batches import micro_batches


def test_rollouts_alone_cut_every_micro_batch_size():
    lengths = dict(enumerate([3, 5, 8, 8, 13]))
    assert micro_batches(list(lengths), lengths, rows=2, tokens=None) == [[0, 1], [2, 3], [4]]


def test_a_token_budget_bounds_rows_times_the_longest_row():
    lengths = dict(enumerate([10, 10, 10, 20, 20, 50, 90]))
    cut = micro_batches(list(lengths), lengths, rows=16, tokens=40)
    assert cut == [[0, 1, 2], [3, 4], [5], [6]], "a rollout over the budget goes alone"
    assert [i for batch in cut for i in batch] == list(lengths), "every rollout once, in order"
    assert all(len(batch) * max(lengths[i] for i in batch) <= 40 for batch in cut if len(batch) > 1)
    assert micro_batches(list(lengths), lengths, rows=2, tokens=40) == [[0, 1], [2, 3], [4], [5], [6]]


def test_a_token_budget_trains_the_same_weights_as_whole_micro_batches(tiny_model_dir, tmp_path):
    """The same seeded run twice, micro-batches of up to 16 rollouts against at most 40 tokens each (one rollout or
    two at a time here): the same rollouts and, up to float summation order, the same final weights."""
    tokenizer = load_tokenizer(tiny_model_dir)
    finals, rollouts = [], []
    for tokens in (None, 40):
        settings = RLSettings(steps=1, tasks_per_step=2, group_size=4, learning_rate=1e-3, kl_coef=0.01,
                              micro_batch_tokens=tokens)
        out = tmp_path / f"tokens-{tokens}"
        finals.append(trajlab.rl(tiny_model_dir, load_env("arithmetic"), out, tokenizer=tokenizer, seed=3,
                                 rollout=RolloutSettings(max_turns=2, max_new_tokens=8, concurrency=8),
                                 **settings.model_dump()))
        rollouts.append([t.tokens.prompt_ids + t.tokens.completion_ids
                         for t in read_trajectories(out / "rollouts.jsonl")])
    assert rollouts[0] == rollouts[1]
    assert max(len(ids) for ids in rollouts[0]) > 20, "several micro-batches under the budget"
    start = load_model(tiny_model_dir).state_dict()
    (whole, bounded) = (load_model(path).state_dict() for path in finals)
    assert any(not torch.equal(whole[name], start[name]) for name in start), "the step changed the weights"
    for name in whole:
        assert torch.allclose(whole[name], bounded[name], atol=1e-6, rtol=1e-4), name
