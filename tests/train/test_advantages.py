import pytest
import torch

from trajlab.train.advantages import (
    group_advantages,
    group_turn_advantages,
    returns_to_go,
    spread_over_turns,
    turn_rewards_with_terminal,
)

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
