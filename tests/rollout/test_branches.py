"""Templates that rewrite history train one sample per model turn ("branches"), token-exact per sample.

Stock Qwen3's template (its real tokenizer) drops the reasoning of turns before the last user message, so one
growing sequence cannot be a rendering of the conversation. Kept as branches, each turn's prompt is the template's
fresh rendering of the conversation before it, and its completion the turn's tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.chat.test_family_episodes import Dictionary, scripted_policy
from trajlab.chat.parsers import get_parser
from trajlab.chat.template import ChatTemplate, resolve_chat_template
from trajlab.config import RLSettings
from trajlab.data.datasets import sft_dataset
from trajlab.env.registry import EnvSpec
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.families import load_family_tokenizer
from trajlab.rollout.drift import check_token_drift
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode
from trajlab.rollout.samples import split_advantages, turn_samples
from trajlab.rollout.types import TokenRecord
from trajlab.train.advantages import step_advantages


@pytest.fixture(scope="module")
def branched():
    tokenizer = load_family_tokenizer("qwen3")
    template = resolve_chat_template(tokenizer, on_unsafe="branch")
    assert template == tokenizer.chat_template, "the model's own template, not TRL's training variant"
    spec = EnvSpec(name="dictionary", env_cls=Dictionary, system_prompt="You know words.")
    generator = ScriptedGenerator(scripted_policy(parallel=True), tokenizer, template)
    parser = get_parser("auto", tokenizer)
    engine = RolloutEngine(spec, generator, tokenizer, chat_template=template, parser=parser, seed=0)
    return tokenizer, template, parser, asyncio.run(engine.run_episode(Episode("e", {})))


def test_each_turn_is_a_sample_with_the_templates_fresh_prompt(branched):
    tokenizer, template, parser, trajectory = branched
    assert trajectory.status == "success" and trajectory.tokens is None
    assistants = [i for i, m in enumerate(trajectory.messages) if m["role"] == "assistant"]
    assert len(trajectory.branches) == len(assistants) == 6
    chat = ChatTemplate(tokenizer, trajectory.tools, template)
    for branch, index in zip(trajectory.branches, assistants, strict=True):
        history, message = trajectory.messages[:index], trajectory.messages[index]
        assert branch.prompt_ids == tokenizer.encode(chat.render(history, add_generation_prompt=True),
                                                     add_special_tokens=False)
        assert branch.completion_ids == tokenizer.encode(chat.assistant_text(history, message),
                                                         add_special_tokens=False)
        assert branch.loss_mask == [1] * len(branch.completion_ids)
    # the point of branching: the last prompt is the template's own, which dropped the reasoning of the turns
    # before the last user message (and kept that of the turn after it)
    last_prompt = tokenizer.decode(trajectory.branches[-1].prompt_ids)
    assert "Looking up apple, pear." not in last_prompt and "Looking up fig." in last_prompt
    assert "Looking up apple, pear." in tokenizer.decode(trajectory.branches[1].prompt_ids)


def test_the_drift_guard_replays_every_branch(branched):
    tokenizer, template, parser, trajectory = branched
    assert check_token_drift([trajectory], tokenizer, template, parser, max_drift=0.0)[0] == [trajectory]
    branches = [b.model_copy(deep=True) for b in trajectory.branches]
    branches[3].prompt_ids[-5] += 1
    tampered = trajectory.model_copy(update={"branches": branches})
    kept, drifts = check_token_drift([tampered], tokenizer, template, parser, max_drift=1.0)
    assert not kept and drifts[0].turn == 4 and drifts[0].segment == "prompt"
    short = trajectory.model_copy(update={"branches": trajectory.branches[:-1]})
    assert check_token_drift([short], tokenizer, template, parser, max_drift=1.0)[1][0].segment == "model"


def test_a_branched_episode_trains_as_its_turns(branched):
    trajectory = branched[3]
    samples = turn_samples(trajectory)
    assert [s.id for s in samples] == [f"e#turn{k}" for k in range(6)]
    assert [s.tokens for s in samples] == trajectory.branches and all(s.branches is None for s in samples)
    assert [s.turn_rewards for s in samples] == [[r] for r in trajectory.turn_rewards]
    rows = sft_dataset([trajectory], include_failures=False, shortest_per_task=False)
    assert len(rows) == 6
    for row, branch in zip(rows, trajectory.branches, strict=True):
        assert row["input_ids"] == branch.prompt_ids + branch.completion_ids
        assert row["assistant_masks"] == [0] * len(branch.prompt_ids) + [1] * len(branch.completion_ids)


def _branched(group, reward, turn_rewards, lengths):
    branches = [TokenRecord(prompt_ids=[1, 2], completion_ids=[3] * n, loss_mask=[1] * n, logprobs=[-1.0] * n)
                for n in lengths]
    from trajlab.rollout.types import Trajectory

    return Trajectory(id=f"{group}{reward}", env="e", task={}, messages=[], tools=[], reward=reward,
                      status="success", branches=branches, turn_rewards=turn_rewards, group=group)


@pytest.mark.parametrize("credit", ["trajectory", "turn"])
def test_advantages_reach_every_sample_of_an_episode(credit):
    one, other = _branched("g", 1.0, [0.0, 1.0], [2, 3]), _branched("g", 0.0, [0.0, 0.0, 0.0], [1, 1, 2])
    settings = RLSettings(group_size=2, credit=credit, estimator="dr_grpo")
    advantages, _ = step_advantages([one, other], [1.0, 0.0], settings)
    pieces = split_advantages(one, advantages[0])
    assert [len(p) for p in pieces] == [2, 3] and [len(p) for p in split_advantages(other, advantages[1])] == [1, 1, 2]
    if credit == "trajectory":
        assert pieces == [[0.5, 0.5], [0.5] * 3]
    else:  # returns to go 1, 1 against 0, 0 (and nothing to compare at turn 3: the turn before's)
        assert pieces == [[0.5, 0.5], [0.5] * 3]
        assert split_advantages(other, advantages[1]) == [[-0.5], [-0.5], [-0.5, -0.5]]
