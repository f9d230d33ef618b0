"""Rewards as named, weighted functions: checked when the config loads, scored a batch at a time (concurrently),
each logged as ``reward/<name>``, a failing one masking its trajectory, turn-level ones feeding turn credit."""

import asyncio
import time

import pytest

from trajlab.config import RLSettings, load_config
from trajlab.errors import UserError
from trajlab.recipes.arguments import settings_of
from trajlab.rewards import RewardSet
from trajlab.rollout.types import TokenRecord, Trajectory
from trajlab.train.advantages import step_advantages

FNS = "tests.rewards.reward_fns"


def trajectory(i: int, reward: float = 1.0, turns: int = 2, status: str = "success", group: str = "g") -> Trajectory:
    return Trajectory(id=f"t{i}", env="arithmetic", task={"id": i}, messages=[], tools=[], reward=reward,
                      status=status, metrics={"turns": float(turns)}, turn_rewards=[0.25] * turns, group=group)


def test_the_built_in_weights_load_unchanged():
    assert RLSettings(rewards={"env": 1.0, "progress": 1.0}).rewards == {"env": 1.0, "progress": 1.0}


def test_functions_load_from_a_config_file_beside_built_ins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"""env: arithmetic
rl:
  rewards:
    env: 1.0
    brevity: {{function: "{FNS}:brevity", weight: 0.2}}
    gate: {{function: "{FNS}:Threshold", args: {{at: 0.5}}, weight: 0}}
""")
    rewards = load_config(path).rl.rewards
    assert rewards["env"] == 1.0
    assert (rewards["brevity"].function, rewards["brevity"].weight) == (f"{FNS}:brevity", 0.2)
    assert rewards["gate"].args == {"at": 0.5}


@pytest.mark.parametrize(("spec", "message"), [
    ({"function": "no_such_pkg.rewards:score"}, "cannot import 'no_such_pkg.rewards'"),
    ({"function": f"{FNS}:missing"}, f"'{FNS}' has no 'missing'"),
    ({"function": f"{FNS}:NOT_CALLABLE"}, "is a int, not a function or class"),
    ({"function": f"{FNS}"}, "is an import path 'my_pkg.rewards:score'"),
    ({"function": f"{FNS}:scaled", "args": {"factr": 2}}, "cannot take args ['factr']"),
    ({"function": f"{FNS}:Threshold"}, "missing a required argument: 'at'"),
    ({"function": f"{FNS}:brevity", "wieght": 1}, "unknown key (did you mean 'weight'?)"),
    ({"function": f"{FNS}:brevity", "level": "step"}, "'trajectory' or 'turn'"),
])
def test_a_bad_reward_function_is_a_config_error_that_says_why(spec, message):
    with pytest.raises(UserError, match="rewards.b") as error:
        settings_of(RLSettings, {"rewards": {"env": 1.0, "b": spec}})
    assert message in str(error.value)


def test_built_in_names_stay_built_in():
    with pytest.raises(UserError, match=r"Unknown reward component\(s\) \['envv'\]"):
        settings_of(RLSettings, {"rewards": {"envv": 1.0}})
    with pytest.raises(UserError, match=r"\['progress'\] are built-in components"):
        settings_of(RLSettings, {"rewards": {"progress": {"function": f"{FNS}:brevity"}}})


def test_each_reward_is_logged_and_weighted_weight_zero_only_logged():
    rewards = RewardSet({"env": 1.0, "brevity": {"function": f"{FNS}:brevity", "weight": 0.5},
                         "three": {"function": f"{FNS}:scaled", "args": {"factor": 3.0}, "weight": 0.0},
                         "gate": {"function": f"{FNS}:Threshold", "args": {"at": 0.5}, "weight": 2.0}})
    batch = [trajectory(0, reward=1.0, turns=2), trajectory(1, reward=0.0, turns=4)]
    scores = rewards.score(batch)
    assert scores.totals == pytest.approx([1.0 + 0.5 * 0.5 + 2.0, 0.0 + 0.5 * 0.25])
    assert [t.metrics["reward/three"] for t in batch] == [3.0, 3.0], "weight 0: logged, not trained"
    assert [t.metrics["reward/brevity"] for t in batch] == [0.5, 0.25]
    assert batch[0].metrics["reward/gate"] == 1.0 and batch[1].metrics["reward/gate"] == 0.0
    assert batch[0].metrics["reward/env"] == 1.0 and "reward/progress" in batch[0].metrics
    assert rewards._built["gate"].calls == 2, "a class is built once for the run"


@pytest.mark.parametrize("name", ["slow", "slow_async"])
def test_a_batch_of_slow_calls_runs_concurrently(name):
    rewards = RewardSet({"grade": {"function": f"{FNS}:{name}"}})
    batch = [trajectory(i) for i in range(8)]
    started = time.perf_counter()
    rewards.score(batch)
    assert time.perf_counter() - started < 1.5, "8 calls of 0.3 s each, at once"
    assert {t.metrics["reward/grade"] for t in batch} in ({0.5}, {0.25})


def test_a_failing_function_marks_its_trajectory_error_and_the_batch_goes_on():
    rewards = RewardSet({"env": 1.0, "flaky": {"function": f"{FNS}:flaky"}})
    batch = [trajectory(0), trajectory(1), trajectory(2, status="error")]
    scores = rewards.score(batch)
    assert [t.status for t in batch] == ["success", "error", "error"]
    assert batch[1].error == ("reward 'flaky' (tests.rewards.reward_fns:flaky) failed: RuntimeError: the grader's "
                              "database is locked")
    assert batch[0].metrics["reward/flaky"] == 1.0 and scores.totals[0] == 2.0
    assert "reward/flaky" not in batch[2].metrics, "an episode that already broke is not graded"
    advantages, stats = step_advantages(batch, scores.totals, RLSettings(group_size=3))
    assert not any(advantages[1]) and stats["groups_skipped"] == 1.0, "masked: no advantage, no group"


def test_a_wrong_return_is_recorded_as_the_functions_failure():
    batch = [trajectory(0)]
    RewardSet({"bug": {"function": f"{FNS}:wrong_shape"}}).score(batch)
    assert batch[0].status == "error" and "returns a number, got list (one per turn: set level: turn)" in batch[0].error
    batch = [trajectory(0, turns=3)]
    RewardSet({"bug": {"function": f"{FNS}:wrong_shape", "level": "turn"}}).score(batch)
    assert "3 turns, 1 numbers" in batch[0].error


def test_turn_level_rewards_feed_turn_credit():
    """Two rollouts of three turns, the same total: one was paid on its first turn, the other on its last. Trajectory
    credit sees no difference; with credit: turn the turn-level rewards reach the tokens of the turns they paid."""
    config = {"env": 0.0, "paid": {"function": f"{FNS}:paid_turn", "level": "turn", "weight": 1.0}}
    first, last = trajectory(0, turns=3), trajectory(1, turns=3)
    first.task, last.task = {"paid": 0}, {"paid": 2}
    mask = [0, 1, 1, 0, 1, 0, 0, 1]  # three model turns of 2, 1 and 1 tokens between observations
    for t in (first, last):
        t.tokens = TokenRecord(prompt_ids=[1], completion_ids=list(range(len(mask))), loss_mask=mask,
                               logprobs=[None] * len(mask))
    scores = RewardSet(config).score([first, last])
    assert scores.totals == [1.0, 1.0] and scores.turns == [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    assert first.metrics["reward/paid"] == last.metrics["reward/paid"] == 1.0, "logged as the sum of its turns"
    by_trajectory, _ = step_advantages([first, last], scores.totals, RLSettings(rewards=config, group_size=2))
    assert not any(by_trajectory[0] + by_trajectory[1])
    settings = RLSettings(rewards=config, credit="turn", estimator="dr_grpo", group_size=2)
    by_turn, _ = step_advantages([first, last], scores.totals, settings, turn_rewards=scores.turns)
    # returns to go: first [1, 0, 0], last [1, 1, 1] -> turn 0 equal, turns 1 and 2 favour last
    assert by_turn[0] == [0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0, -0.5]
    assert by_turn[1] == [0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.5]


def test_scoring_from_inside_a_running_event_loop():
    """A rollout's on_result callback (prompt evolution scores each episode there) runs inside the engine's loop:
    the batch is scored in a thread of its own instead of failing to start a second loop."""
    async def in_a_callback() -> list[float]:
        return RewardSet({"grade": {"function": f"{FNS}:slow_async"}}).score([trajectory(0)]).totals

    assert asyncio.run(in_a_callback()) == [0.25]
