"""Named reference policies (``collect.reference``): an env's imperfect demonstrators, chosen by name, recorded as
such, and refused with a clear message where they cannot run."""

import json

import pytest
from typer.testing import CliRunner

import trajlab
from trajlab.cli import app
from trajlab.collection.demonstrators import demonstrator
from trajlab.collection.engines import build_runner
from trajlab.collection.plan import episode_tag, plan_episodes
from trajlab.config import ModelSettings, RolloutSettings
from trajlab.env.builtin import arithmetic, driving, guess
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import load_env
from trajlab.errors import UserError
from trajlab.models.loading import load_tokenizer
from trajlab.models.tiny import ensure_default_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_default_model())


def _calls(trajectory):
    return [call["function"]["name"] for message in trajectory.messages if message["role"] == "assistant"
            for call in message.get("tool_calls") or []]


def test_the_overconfident_driver_stops_too_late_only_where_a_lane_change_would_have_worked(tmp_path, tokenizer):
    spec = load_env("driving")
    own = trajlab.collect(spec, "oracle", out=tmp_path / "own.jsonl", episodes=300, tokenizer=tokenizer)
    flawed = trajlab.collect(spec, "oracle", out=tmp_path / "flawed.jsonl", episodes=300, reference="overconfident",
                         tokenizer=tokenizer)
    assert all(t.status == "success" and t.policy == "oracle" for t in own)
    assert [t.task for t in flawed] == [t.task for t in own]  # the same tasks, other episodes
    assert all(t.policy == "oracle:overconfident" and t.id.endswith(":reference-overconfident") for t in flawed)
    failed = [t for t in flawed if t.status != "success"]
    assert 0.1 < len(failed) / len(flawed) < 0.3  # the docs' "about a fifth"
    for trajectory in failed:  # each a stop that came too late, on a task the env's own reference swerves on
        assert _calls(trajectory) == ["observe", "emergency_stop"] and trajectory.metrics["env/collision"] == 1
        assert driving.plan(driving.first_scene(trajectory.task))[1] == "lane_change"
    # where braking does work, it brakes, even where the env's own reference would swerve for a wider margin
    # (a margin of 10 m or more earns the full reward, so its reward is at most the same)
    braked_instead = [(t.reward, o.reward) for t, o in zip(flawed, own, strict=True)
                      if t.status == "success" and _calls(t)[-1] == "emergency_stop" and _calls(o)[-1] == "lane_change"]
    assert braked_instead and all(mine <= theirs for mine, theirs in braked_instead)
    assert sum(mine for mine, _ in braked_instead) < sum(theirs for _, theirs in braked_instead)


@pytest.mark.slow(29)
def test_the_sign_slip_drops_the_minus_of_a_negative_product_on_three_tasks_in_four(tmp_path, tokenizer):
    own = trajlab.collect("arithmetic", "oracle", out=tmp_path / "own.jsonl", episodes=600, tokenizer=tokenizer)
    flawed = trajlab.collect("arithmetic", "oracle", out=tmp_path / "flawed.jsonl", episodes=600,
                         reference="sign_slip", tokenizer=tokenizer)
    assert [t.task for t in flawed] == [t.task for t in own]
    negative_products = [t for t in flawed if t.task["ops"][-1] == "multiply" and t.task["answer"] < 0]
    slipped = [t for t in negative_products if t.status != "success"]
    assert 0.6 < len(slipped) / len(negative_products) < 0.9  # the docs' "three in four"
    assert 0.02 < len(slipped) / len(flawed) < 0.06
    for trajectory, mine in zip(flawed, own, strict=True):
        submitted = trajectory.messages[-2]["tool_calls"][0]["function"]["arguments"]["answer"]
        slips = trajectory in slipped
        assert slips == (trajectory in negative_products and arithmetic.slips(trajectory.task["question"]))
        assert submitted == (abs(trajectory.task["answer"]) if slips else trajectory.task["answer"])
        assert _calls(trajectory) == _calls(mine)  # every call before the submit is the env's own reference's
    again = trajlab.collect("arithmetic", "oracle", out=tmp_path / "again.jsonl", episodes=600, reference="sign_slip",
                        tokenizer=tokenizer, seed=1)
    for trajectory in again:  # another seed, other tasks; a task slips or not by its question alone
        band = trajectory.task["ops"][-1] == "multiply" and trajectory.task["answer"] < 0
        assert (trajectory.status != "success") == (band and arithmetic.slips(trajectory.task["question"]))


def test_the_impatient_player_gives_up_after_four_wrong_guesses_on_three_episodes_in_four(tmp_path, tokenizer):
    own = trajlab.collect("guess", "oracle", out=tmp_path / "own.jsonl", episodes=324, tokenizer=tokenizer)
    flawed = trajlab.collect("guess", "oracle", out=tmp_path / "flawed.jsonl", episodes=324, reference="impatient",
                         tokenizer=tokenizer)
    assert [t.task for t in flawed] == [t.task for t in own]  # every train task twice
    assert all(t.status == "success" for t in own) and all(t.policy == "oracle:impatient" for t in flawed)
    long_games = [t for t, mine in zip(flawed, own, strict=True) if len(_calls(mine)) > guess.GIVE_UP_AFTER]
    given_up = [t for t in flawed if t.status != "success"]
    assert set(map(id, given_up)) <= set(map(id, long_games))  # it gives up only where the search goes on
    assert 0.65 < len(given_up) / len(long_games) < 0.85  # the docs' "three episodes in four"
    for trajectory, mine in zip(flawed, own, strict=True):
        if trajectory in given_up:  # four wrong guesses, the binary search's own, then the words and no call
            assert _calls(trajectory) == ["guess"] * guess.GIVE_UP_AFTER
            assert trajectory.messages[:-1] == mine.messages[:len(trajectory.messages) - 1]
            assert trajectory.messages[-1] == {"role": "assistant", "content": guess.GIVE_UP_MESSAGE}
            assert trajectory.reward == 0.0
        else:
            assert trajectory.messages == mine.messages and trajectory.reward == mine.reward
    # drawn per episode: some task is demonstrated both ways; the same command draws the same again
    outcomes = {}
    for trajectory in flawed:
        outcomes.setdefault(trajectory.task["task_id"], set()).add(trajectory.status)
    assert any(len(statuses) == 2 for statuses in outcomes.values())
    again = trajlab.collect("guess", "oracle", out=tmp_path / "again.jsonl", episodes=324, reference="impatient",
                        tokenizer=tokenizer)
    assert [t.messages for t in again] == [t.messages for t in flawed]


def test_a_named_reference_composes_with_noise(tmp_path, tokenizer):
    trajectories = trajlab.collect("driving", "oracle", out=tmp_path / "x.jsonl", episodes=4, reference="overconfident",
                               reference_noise=1.0, tokenizer=tokenizer)
    assert all(t.policy == "oracle:overconfident+noise1" for t in trajectories)
    assert all(t.id.endswith(":reference-overconfident:noise-1") for t in trajectories)


def test_a_reference_the_env_lacks_a_mixture_or_another_policy_is_refused(tmp_path):
    spec = load_env("driving")

    def chosen(env, reference, policy="oracle", noise=0.0):
        return demonstrator(env, policy, reference=reference, noise=noise, seed=0)

    with pytest.raises(UserError, match="driving has no reference policy 'reckless'; it has: overconfident"):
        chosen(spec, "reckless")
    with pytest.raises(UserError, match="arithmetic has no reference policy 'overconfident'; it has: sign_slip"):
        chosen(load_env("arithmetic"), "overconfident")
    with pytest.raises(UserError, match="wordle has no reference policy 'overconfident'; it has: none"):
        chosen(load_env("wordle"), "overconfident")
    with pytest.raises(UserError, match="needs --policy oracle"):
        chosen(spec, "overconfident", policy=str(tmp_path))
    with pytest.raises(UserError, match="the reference 'impatient' draws anew in every episode"):
        chosen(load_env("guess"), "impatient", noise=0.1)
    mixture = EnvMixture({"driving": spec, "arithmetic": load_env("arithmetic")})
    with pytest.raises(UserError, match="collect each env of the mixture"):
        chosen(mixture, "overconfident")
    with pytest.raises(UserError, match="run in this process only"):
        build_runner(spec, "oracle", rollout=RolloutSettings(workers=2), model=ModelSettings(), temperature=1.0,
                     seed=0, tokenizer=None, demonstrator=chosen(spec, "overconfident"), run_dir=tmp_path)

    def plan(reference):
        return plan_episodes(spec, split="train", seed=0, episodes=2, samples_per_task=1, tasks=None,
                             tag=episode_tag(spec, None, reference, 0.0))

    assert [e.id + ":reference-overconfident" for e in plan(None)] == [e.id for e in plan("overconfident")]


def test_trajlab_collect_takes_a_reference(tmp_path):
    out = tmp_path / "demos.jsonl"
    result = CliRunner().invoke(app, ["collect", "--env", "driving", "--policy", "oracle", "--episodes", "6",
                                      "--reference", "overconfident", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    assert [json.loads(line)["policy"] for line in out.read_text().splitlines()] == ["oracle:overconfident"] * 6


def test_run_refuses_an_unknown_reference_before_its_first_stage(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nenv: driving\nstages: [eval, collect]\n"
                      "collect: {episodes: 4, reference: overconfidant}\neval: {num_tasks: 2}\n")
    result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 1 and "driving has no reference policy 'overconfidant'" in result.stdout
    assert not (tmp_path / "run" / "eval-0-untrained").exists()
