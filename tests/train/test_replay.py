"""Replaying logged demonstrations in RL: each weighted by its reward against the log's, drawn the same way on every
process and resume, and trained so that a successful one becomes likelier and a failed one less likely."""

from __future__ import annotations

import json

import pytest
import torch

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.data.store import TrajectoryStore, read_trajectories
from trajlab.env import load_env
from trajlab.errors import UserError
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.rewards import RewardSet
from trajlab.train.replay import DemonstrationReplay

ROLLOUT = RolloutSettings(max_turns=4, max_new_tokens=40, concurrency=8)


@pytest.fixture(scope="module")
def demonstrations(tiny_model_dir, tmp_path_factory):
    """Arithmetic's reference erring in half of its situations: successes and failures, token ids kept."""
    out = tmp_path_factory.mktemp("replay") / "demos.jsonl"
    logged = trajlab.collect(load_env("arithmetic"), "oracle", out=out, tokenizer=str(tiny_model_dir), seed=0,
                             rollout=ROLLOUT, episodes=24, reference_noise=0.5)
    assert {t.status for t in logged} >= {"success", "failure"}
    return out


def model_tokens_logprob(model, trajectory) -> float:
    """The model's summed logprob of the trajectory's model tokens."""
    tokens = trajectory.tokens
    ids = torch.tensor([tokens.prompt_ids + tokens.completion_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    start = len(tokens.prompt_ids) - 1
    return sum(lp for lp, bit in zip(logprobs[start:].tolist(), tokens.loss_mask, strict=True) if bit)


@pytest.mark.parametrize("credit", ["trajectory", "turn"])
def test_successes_get_positive_advantages_failures_negative_and_draws_repeat(demonstrations, credit):
    logged = list(read_trajectories(demonstrations))
    settings = RLSettings(replay_demonstrations=5, credit=credit, replay_below_baseline=True)
    replay = DemonstrationReplay(logged, RewardSet({"env": 1.0}), settings, seed=3)
    for trajectory, advantages in zip(replay.demonstrations, replay.advantages, strict=True):
        last_turn = [a for a, bit in zip(advantages, trajectory.tokens.loss_mask, strict=True) if bit][-1]
        assert (last_turn > 0) == (trajectory.status == "success") == (last_turn >= 0), (trajectory.status, last_turn)
    first, again = replay.draw(7), DemonstrationReplay(logged, RewardSet({"env": 1.0}), settings, seed=3).draw(7)
    assert [t.id for t in first[0]] == [t.id for t in again[0]] and len(first[0]) == 5, "the same on every process"
    assert [t.id for t in replay.draw(8)[0]] != [t.id for t in first[0]]
    assert all(t.tokens.logprobs == logged_t.tokens.logprobs for t in first[0]
               for logged_t in logged if logged_t.id == t.id), "draws are copies: the log is never changed"


def test_without_below_baseline_replay_only_better_turns_carry_weight(demonstrations):
    """Self-imitation: a failed turn's negative advantage is dropped, a successful turn's kept as it was."""
    logged = list(read_trajectories(demonstrations))
    both = DemonstrationReplay(logged, RewardSet({"env": 1.0}), RLSettings(
        replay_demonstrations=2, credit="turn", replay_below_baseline=True), 0)
    above = DemonstrationReplay(logged, RewardSet({"env": 1.0}), RLSettings(
        replay_demonstrations=2, credit="turn", replay_below_baseline=False), 0)
    assert any(a < 0 for row in both.advantages for a in row)
    assert [[max(a, 0.0) for a in row] for row in both.advantages] == above.advantages


def test_sign_weighting_gives_every_better_turn_a_rollouts_full_weight(demonstrations):
    """A log that mostly succeeds puts its successes barely above its average; weighted by sign, each better turn
    weighs 1 however small its advantage, each worse one -1 (0 without below-baseline), an unscored token 0."""
    logged = list(read_trajectories(demonstrations))
    scaled = DemonstrationReplay(logged, RewardSet({"env": 1.0}), RLSettings(
        replay_demonstrations=2, credit="turn", replay_below_baseline=True), 0)
    signs = DemonstrationReplay(logged, RewardSet({"env": 1.0}), RLSettings(
        replay_demonstrations=2, credit="turn", replay_weighting="sign", replay_below_baseline=True), 0)
    above = DemonstrationReplay(logged, RewardSet({"env": 1.0}), RLSettings(
        replay_demonstrations=2, credit="turn", replay_weighting="sign", replay_below_baseline=False), 0)
    assert any(0 < abs(a) != 1 for row in scaled.advantages for a in row), "the log's advantages vary in size"
    for scaled_row, sign_row, above_row in zip(scaled.advantages, signs.advantages, above.advantages, strict=True):
        assert sign_row == [1.0 if a > 0 else -1.0 if a < 0 else 0.0 for a in scaled_row]
        assert above_row == [max(a, 0.0) for a in sign_row]
    assert {a for row in signs.advantages for a in row} == {-1.0, 0.0, 1.0}
    assert {a for row in above.advantages for a in row} == {0.0, 1.0}


def test_errored_demonstrations_are_left_out_and_two_are_needed(demonstrations):
    logged = list(read_trajectories(demonstrations))
    broken = logged[0].model_copy(update={"status": "error", "id": "broken"})
    replay = DemonstrationReplay([*logged, broken], RewardSet({"env": 1.0}), RLSettings(replay_demonstrations=2), 0)
    assert "broken" not in {t.id for t in replay.demonstrations}
    with pytest.raises(ValueError, match="at least 2 demonstrations"):
        DemonstrationReplay(logged[:1], RewardSet({"env": 1.0}), RLSettings(replay_demonstrations=2), 0)


def test_a_step_of_replay_alone_raises_the_success_and_lowers_the_failure(tiny_model_dir, demonstrations, tmp_path):
    """The untrained model fails every rollout, so its groups carry no signal: the step's gradient is the replayed
    demonstrations' alone, one success and one failure of the same kind of task."""
    logged = list(read_trajectories(demonstrations))
    pair = [next(t for t in logged if t.status == s) for s in ("success", "failure")]
    with TrajectoryStore(tmp_path / "pair.jsonl") as store:
        for trajectory in pair:
            store.append(trajectory)
    before = load_model(tiny_model_dir)
    final = trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path / "rl",
                       tokenizer=load_tokenizer(tiny_model_dir), rollout=ROLLOUT, steps=1, tasks_per_step=1,
                       group_size=2, learning_rate=1e-3, warmup_steps=0, rate_by_failures=False,
                       replay_demonstrations=2, replay_below_baseline=True, demonstrations=str(tmp_path / "pair.jsonl"))
    (record,) = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout/zero_variance_groups"] == 1.0 and record["replay/demonstrations"] == 2.0
    after = load_model(final)
    success, failure = ((model_tokens_logprob(after, t) - model_tokens_logprob(before, t)) for t in pair)
    assert success > 0 > failure, (success, failure)


def test_replay_without_a_demonstrations_file_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="rl.demonstrations"):
        trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path, rollout=ROLLOUT, steps=1, tasks_per_step=1,
                   group_size=2, replay_demonstrations=2)
    with pytest.raises(UserError, match="cannot read"):
        trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path, rollout=ROLLOUT, steps=1, tasks_per_step=1,
                   group_size=2, replay_demonstrations=2, demonstrations=str(tmp_path / "missing.jsonl"))


def test_the_default_replay_steps_aside_where_a_set_one_is_refused(tiny_model_dir, demonstrations, tmp_path, caplog):
    """A file of one demonstration gives a replay nothing to compare: the default recipe's replay is then off and
    says so (a pipeline with one demonstration still trains), while a replay set explicitly is refused."""
    one = tmp_path / "one.jsonl"
    with TrajectoryStore(one) as store:
        store.append(next(t for t in read_trajectories(demonstrations) if t.status == "success"))
    with caplog.at_level("WARNING", logger="trajlab.recipes.rl"):
        trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path / "rl", tokenizer=load_tokenizer(tiny_model_dir),
                   rollout=ROLLOUT, steps=1, tasks_per_step=1, group_size=2, demonstrations=str(one))
    assert "1 of its 1 demonstrations can be replayed" in caplog.text and "none replayed" in caplog.text
    (record,) = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert "replay/demonstrations" not in record
    with pytest.raises(ValueError, match="at least 2 demonstrations"):
        trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path / "set", tokenizer=load_tokenizer(tiny_model_dir),
                   rollout=ROLLOUT, steps=1, tasks_per_step=1, group_size=2, demonstrations=str(one),
                   replay_demonstrations=2)
