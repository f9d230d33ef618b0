"""Advantages within groups of rollouts of the same task: the estimators, turn-level credit, and a step's groups as
the RL loop makes them (a task's place in the step, errors left out)."""

import asyncio

import pytest
import torch

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat_template
from trajlab.config import RLSettings
from trajlab.env import load_env
from trajlab.env.mixture import load_envs
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.loading import load_tokenizer
from trajlab.rollout.engine import make_engine
from trajlab.rollout.types import task_id
from trajlab.train.advantages import (
    group_advantages,
    group_turn_advantages,
    returns_to_go,
    spread_over_turns,
    step_advantages,
    turn_rewards_with_terminal,
)
from trajlab.train.rl import group_episodes

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5])


def test_grpo_centers_and_scales():
    adv = group_advantages(REWARDS, "grpo")
    assert adv.mean().abs() < 1e-6
    assert torch.allclose(adv, (REWARDS - 0.5) / (REWARDS.std() + 1e-4))


def test_dr_grpo_only_centers():
    assert torch.allclose(group_advantages(REWARDS, "dr_grpo"), REWARDS - 0.5)


def test_rloo_is_leave_one_out():
    adv = group_advantages(REWARDS, "rloo")
    expected = torch.tensor([r - (REWARDS.sum() - r) / 3 for r in REWARDS.tolist()])
    assert torch.allclose(adv, expected)


def test_equal_rewards_give_no_signal():
    for estimator in ("grpo", "dr_grpo", "rloo"):
        assert torch.all(group_advantages(torch.ones(4), estimator) == 0)
        # 1 + 2/3 (a success plus a progress reward) is not exact in floating point: its group mean is off by an
        # ulp, which grpo's division by (std + eps) once turned into advantages of about -0.001
        assert torch.all(group_advantages(torch.full((8,), 1 + 2 / 3), estimator) == 0)
        assert torch.all(group_advantages(torch.full((7,), 0.1 + 0.2), estimator) == 0)


def test_turn_level_credit():
    assert returns_to_go([0.2, 0.0, 1.0]) == pytest.approx([1.2, 1.0, 1.0])
    # dense rewards of 1/3 per correct step and a terminal reward of 1: the terminal share lands on the last turn
    assert turn_rewards_with_terminal([1 / 3, 1 / 3, 1 / 3], total=2.0, dense_weight=1.0) == pytest.approx(
        [1 / 3, 1 / 3, 4 / 3])
    adv = group_turn_advantages([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], "dr_grpo")
    # turn 0 returns: 1, 0, 1 -> mean 2/3; turn 1 returns: 0, 0, 1 -> mean 1/3
    assert adv[0] == pytest.approx([1 / 3, -1 / 3])
    assert adv[1] == pytest.approx([-2 / 3, -1 / 3])
    assert adv[2] == pytest.approx([1 / 3, 2 / 3])


def test_a_turn_only_one_rollout_reached_keeps_its_previous_advantage():
    adv = group_turn_advantages([[1.0, 0.0, 0.5], [0.0]], "dr_grpo")
    assert adv[0][2] == adv[0][1]
    assert adv[1] == [pytest.approx(-0.75)]


def test_spread_over_turns_credits_each_run_of_model_tokens():
    mask = [1, 1, 0, 0, 1, 0, 1, 1]
    assert spread_over_turns(mask, [0.5, -1.0, 2.0]) == [0.5, 0.5, 0, 0, -1.0, 0, 2.0, 2.0]


def test_groups_are_the_steps_tasks_even_when_two_envs_repeat_a_task_id_and_ids_are_never_parsed(tiny_model_dir):
    mixture = load_envs("arithmetic,guess")
    tokenizer = load_tokenizer(tiny_model_dir)
    template = resolve_chat_template(tokenizer)
    step_tasks = [{**task, "task_id": "0"} for _, task in zip(range(2), mixture.iter_tasks("train", seed=0),
                                                              strict=False)]
    assert [task["env"] for task in step_tasks] == ["arithmetic", "guess"]
    episodes = [e for i, task in enumerate(step_tasks) for e in group_episodes(3, i, task, group_size=2)]
    engine = make_engine(mixture, ScriptedGenerator(mixture.oracle, tokenizer, template), tokenizer,
                         chat_template=template, parser=get_parser("auto", tokenizer), seed=0)
    trajectories = sorted(asyncio.run(engine.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0)),
                          key=lambda t: t.id)  # the engine returns them as done
    assert [(t.env, task_id(t.task), t.group) for t in trajectories] == [
        ("arithmetic", "0", "rl:3:0"), ("arithmetic", "0", "rl:3:0"), ("guess", "0", "rl:3:1"), ("guess", "0", "rl:3:1")
    ]
    rewards = [1.0, 0.0, 1.0, 1.0]  # arithmetic's group has signal, guess's is flat
    settings = RLSettings(estimator="dr_grpo", credit="trajectory")

    def per_rollout(ts):
        advantages, stats = step_advantages(ts, rewards, settings)
        values = [{a for a, bit in zip(adv, t.tokens.loss_mask, strict=True) if bit} for adv, t in zip(advantages, ts,
                                                                                                        strict=True)]
        return values, stats["zero_variance_groups"]

    # One group of four (by task id) would give 0.25, -0.75, 0.25, 0.25 and no flat group.
    assert per_rollout(trajectories) == ([{0.5}, {-0.5}, {0.0}, {0.0}], 0.5)
    # Ids in any format, even ones whose prefixes would all say "one group": grouping follows Trajectory.group only.
    renamed = [t.model_copy(update={"id": f"same:{n}"}) for n, t in enumerate(trajectories)]
    assert per_rollout(renamed) == ([{0.5}, {-0.5}, {0.0}, {0.0}], 0.5)
    with pytest.raises(ValueError, match="has no group"):
        step_advantages([t.model_copy(update={"group": None}) for t in trajectories], rewards, settings)

def test_an_episode_the_machinery_broke_is_no_zero_reward_in_its_group(tiny_model_dir):
    """A rollout with status error gets no advantage and is left out of its group's statistics; a group with fewer
    than two valid rollouts is skipped, not compared."""
    env = load_env("arithmetic")
    tokenizer = load_tokenizer(tiny_model_dir)
    template = resolve_chat_template(tokenizer)
    tasks = [task for _, task in zip(range(2), env.iter_tasks("train", seed=0), strict=False)]
    episodes = [e for i, task in enumerate(tasks) for e in group_episodes(0, i, task, group_size=3)]
    engine = make_engine(env, ScriptedGenerator(env.oracle, tokenizer, template), tokenizer, chat_template=template,
                         parser=get_parser("auto", tokenizer), seed=0)
    done = sorted(asyncio.run(engine.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0)), key=lambda t: t.id)
    broken = {0, 3, 4}  # one of the first group's three, two of the second's
    trajectories = [t.model_copy(update={"status": "error", "error": "the generator failed"}) if i in broken else t
                    for i, t in enumerate(done)]
    rewards = [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # as a zero, the error would pull its group's baseline down
    advantages, stats = step_advantages(trajectories, rewards, RLSettings(estimator="dr_grpo", group_size=3,
                                                                         credit="trajectory"))
    model_values = [{a for a, bit in zip(adv, t.tokens.loss_mask, strict=True) if bit}
                    for adv, t in zip(advantages, trajectories, strict=True)]
    assert model_values == [{0.0}, {0.5}, {-0.5}, {0.0}, {0.0}, {0.0}]
    assert stats == {"zero_variance_groups": 0.0, "groups_short": 2.0, "groups_skipped": 1.0}
