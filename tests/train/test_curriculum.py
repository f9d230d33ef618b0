"""Curricula on the real tiny model: stages drawn in order, promotions logged, a run resumed mid-curriculum."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

import trajlab
from trajlab.config import ConfigError, load_config
from trajlab.data.store import read_trajectories, task_keys
from trajlab.env import EnvSpec, load_env
from trajlab.env.mixture import EnvMixture
from trajlab.recipes.pipeline import run_pipeline
from trajlab.rollout.types import task_id
from trajlab.train.curriculum import Curriculum, build_stages

from .test_tracking import undocumented

ROLLOUT = {"max_turns": 1, "max_new_tokens": 8, "concurrency": 8}


def rl(model_dir, out, curriculum, env="arithmetic", rollout=None, **settings) -> list[dict]:
    settings = {"steps": 3, "tasks_per_step": 2, "group_size": 2, "save_steps": 1, "learning_rate": 1e-3} | settings
    trajlab.rl(model_dir, env, out, device="cpu", rollout=ROLLOUT | (rollout or {}), curriculum=curriculum,
               **settings)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_tasks(out) -> dict[int, list[tuple[str, str]]]:
    """Each step's rollouts as (env, task id), in the order the step ran them."""
    steps: dict[int, list[tuple[str, str]]] = {}
    for trajectory in read_trajectories(out / "rollouts.jsonl"):
        steps.setdefault(int(trajectory.metrics["rl/step"]), []).append((trajectory.env, trajectory.task["task_id"]))
    return steps


def promotions(out) -> list[dict]:
    return [json.loads(line) for line in (out / "curriculum.jsonl").read_text().splitlines()]


THREE_STAGES = {"stages": [
    {"name": "small", "difficulty": {"max_operand": 2}, "promote": {"steps": 1}},
    {"name": "mixed", "env": {"arithmetic": 1, "guess": 1}, "difficulty": {"min_high": 4, "max_high": 8},
     "promote": {"metric": "heldout_success", "every": 1, "tasks": 2, "threshold": 0.0}},
    {"name": "wide", "env": "guess", "difficulty": {"min_high": 64}, "max_turns": 2},
]}


@pytest.mark.parametrize("workers", [0, pytest.param(2, id="rollout workers", marks=pytest.mark.slow(25))])
def test_each_step_draws_from_its_stage_and_every_promotion_is_logged(tiny_model_dir, tmp_path, workers):
    """In-process, and on Ray rollout workers, which hold an engine per stage (its env, knobs and limits)."""
    if workers:
        pytest.importorskip("ray")
    records = rl(tiny_model_dir, tmp_path, THREE_STAGES, rollout={"workers": workers})
    assert ("rollout/workers_replaced" in records[0]) == bool(workers), "the episodes ran where they were asked to"
    assert [r["curriculum/stage"] for r in records] == [0, 1, 2]
    assert "curriculum/heldout_success" in records[1] and "curriculum/heldout_success" not in records[0]
    assert undocumented({name for record in records for name in record}) == []
    assert [(p["step"], p["from"], p["to"], p["rule"]) for p in promotions(tmp_path)] == [
        (1, "small", "mixed", "steps"), (2, "mixed", "wide", "heldout_success")]
    rollouts = {step: [t for t in read_trajectories(tmp_path / "rollouts.jsonl") if t.metrics["rl/step"] == step]
                for step in (1, 2, 3)}
    assert all(t.env == "arithmetic" and max(t.task[k] for k in "abc") <= 2 for t in rollouts[1])
    assert {t.env for t in rollouts[2]} == {"arithmetic", "guess"}
    assert all(t.task["high"] <= 8 for t in rollouts[2] if t.env == "guess")
    assert all(max(t.task[k] for k in "abc") <= 9 for t in rollouts[2] if t.env == "arithmetic"), "knobs reset"
    assert all(t.env == "guess" and t.task["high"] >= 64 and t.metrics["turns"] <= 2 for t in rollouts[3])
    state = json.loads((tmp_path / "checkpoint" / "trajlab_state.json").read_text())
    assert state["curriculum"]["stage"] == 2 and state["curriculum"]["stages"] == ["small", "mixed", "wide"]


def test_a_resumed_run_goes_on_in_the_same_stage_with_the_same_window(tiny_model_dir, tmp_path):
    """Stage "warm" promotes once its window of 2 steps is full (threshold 0): after step 2. A run stopped after step
    1 must keep that one step of window, and draw step 2's tasks where the stage's stream left off."""
    curriculum = {"stages": [
        {"name": "warm", "difficulty": {"max_operand": 3},
         "promote": {"metric": "train_success", "window": 2, "threshold": 0.0}},
        {"name": "rest", "task_filter": {"ops": [["add", "add"], ["multiply", "add"]]}},
    ]}
    through = rl(tiny_model_dir, tmp_path / "through", curriculum)
    rl(tiny_model_dir, tmp_path / "resumed", curriculum, steps=1)
    state = json.loads((tmp_path / "resumed" / "checkpoint" / "trajlab_state.json").read_text())["curriculum"]
    assert state["stage"] == 0 and len(state["window"]) == 1 and state["steps"] == 1
    resumed = rl(tiny_model_dir, tmp_path / "resumed", curriculum, steps=3, resume=True)

    assert [r["curriculum/stage"] for r in through] == [r["curriculum/stage"] for r in resumed] == [0, 0, 1]
    assert promotions(tmp_path / "through") == promotions(tmp_path / "resumed")
    assert [p["step"] for p in promotions(tmp_path / "resumed")] == [2]
    tasks = step_tasks(tmp_path / "through")
    assert tasks == step_tasks(tmp_path / "resumed")
    assert set(tasks[2]).isdisjoint(tasks[1]), "step 2 goes on in the stage's stream"
    for a, b in zip(through, resumed, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a.get("curriculum/train_success") == b.get("curriculum/train_success")
    last = read_trajectories(tmp_path / "through" / "rollouts.jsonl")
    assert all(t.task["ops"] in (["add", "add"], ["multiply", "add"]) for t in last if t.metrics["rl/step"] == 3)


def test_skipped_tasks_are_never_drawn_unless_they_are_all_the_stage_has(caplog):
    env = load_env("arithmetic")
    first = [task_id(task) for task in itertools.islice(env.iter_tasks("train", 3), 40)]
    curriculum = Curriculum.single(env, {}, seed=3, skip={("arithmetic", key) for key in first[:25]})
    drawn = [task_id(task) for step in range(3) for task in curriculum.draw(step, 5)[1]]
    assert drawn == first[25:40], "the stream goes on past the skipped tasks, in the same order"

    small = load_env("arithmetic").with_options(max_operand=1)  # 1 op 1 op 1: nine tasks in all
    every = [task_id(task) for task in small.iter_tasks("train", 0)]
    alone = Curriculum.single(small, {}, seed=0, skip={("arithmetic", key) for key in every})
    assert [task_id(task) for task in alone.draw(0, len(every))[1]] == every
    assert "every train task is among the" in caplog.text


def renumbered(name: str) -> EnvSpec:
    """An env whose train tasks are numbered t0, t1, ...: two such envs share every task id."""
    spec = load_env(name)

    def tasks(split, seed, **options):
        for number, task in enumerate(spec.tasks(split, seed, **options)):
            yield {**task, "task_id": f"t{number}"}

    return replace(spec, tasks=tasks)


def test_a_skipped_task_is_one_envs_even_where_another_env_of_the_mixture_has_its_id(tmp_path):
    """Tasks are keyed by (env, task_id): leaving out arithmetic's demonstrated tasks keeps guess's of the same ids,
    from the demonstrations file to the tasks RL draws."""
    mixture = EnvMixture({"arithmetic": renumbered("arithmetic"), "guess": renumbered("guess")})
    demos = tmp_path / "demos.jsonl"
    trajlab.collect(mixture.specs["arithmetic"], "oracle", out=demos, episodes=5)
    skipped = task_keys(demos)
    assert skipped == {("arithmetic", f"t{number}") for number in range(5)}
    drawn = [(task["env"], task["task_id"]) for task in
             Curriculum.single(mixture, {}, seed=0, skip=skipped).draw(0, 12)[1]]
    # the mixture's stream alternates the envs; arithmetic's t0-t4 are left out, guess's t0-t4 are not
    assert drawn == [*(("guess", f"t{n}") for n in range(5)), ("arithmetic", "t5"), ("guess", "t5"),
                     ("arithmetic", "t6"), ("guess", "t6"), ("arithmetic", "t7"), ("guess", "t7"), ("arithmetic", "t8")]


def test_curriculum_settings_are_validated():
    def problem(curriculum) -> str:
        with pytest.raises(ConfigError) as error:
            load_config(None, {"env": "arithmetic", "curriculum": curriculum})
        return str(error.value)

    assert "curriculum.stages: List should have at least 1 item" in problem({"stages": []})
    last = {"name": "b"}
    assert "less than or equal to 1" in problem(
        {"stages": [{"name": "a", "promote": {"metric": "train_success", "threshold": 1.5}}, last]})
    assert "every stage but the last needs a promote rule (only the last runs until rl.steps); none in: a" in problem(
        {"stages": [{"name": "a"}, last]})
    assert "the last stage (b) runs until rl.steps" in problem({"stages": [{"name": "b", "promote": {"steps": 2}}]})
    assert "a train_success rule takes metric, threshold, window, not every" in problem(
        {"stages": [{"name": "a", "promote": {"metric": "train_success", "threshold": 0.5, "every": 2}}, last]})
    assert "either {steps: N} or {metric" in problem(
        {"stages": [{"name": "a", "promote": {"steps": 2, "metric": "train_success"}}, last]})
    assert "metric heldout_success needs a threshold" in problem(
        {"stages": [{"name": "a", "promote": {"metric": "heldout_success"}}, last]})
    assert "stage names must be unique; repeated: b" in problem(
        {"stages": [{"name": "b", "promote": {"steps": 1}}, last]})
    assert ("curriculum.stages.0.promte: unknown key (did you mean 'promote'?)" in
            problem({"stages": [{"name": "a", "promte": {"steps": 1}}, last]}))

    rules = [{"steps": 2}, {"metric": "train_success", "threshold": 0.5, "window": 3},
             {"metric": "heldout_success", "threshold": 0.5, "every": 2, "tasks": 4}]
    config = load_config(None, {"env": "arithmetic", "curriculum": {"stages": [
        *({"name": f"s{i}", "promote": rule, "max_turns": 2} for i, rule in enumerate(rules)),
        {"name": "last", "env": {"arithmetic": 2, "guess": 1}, "task_filter": {"high": [16, 32]}}]}})
    assert load_config(None, config.model_dump(mode="json")) == config, "config show's YAML is accepted back"


def test_a_stages_env_knobs_and_filter_are_checked_before_training(tmp_path):
    def build(**stage):
        config = load_config(None, {"env": "arithmetic", "curriculum": {"stages": [{"name": "s", **stage}]}})
        return build_stages(config.curriculum, config.env_spec(), config.rollout)

    with pytest.raises(ConfigError, match="curriculum stage 's': .*Did you mean 'max_operand'"):
        build(difficulty={"max_operands": 3})
    with pytest.raises(ConfigError, match="curriculum stage 's': Unknown environment 'gues'"):
        build(env="gues")
    with pytest.raises(ConfigError, match="weights share the steps between several envs"):
        build(env={"guess": 2})
    with pytest.raises(ConfigError, match=r"no train task of arithmetic among the first 1000 matches task_filter "
                                          r"\{'op': 'add'\} \(task fields: a, answer, b, c, ops, question, task_id\)"):
        build(task_filter={"op": "add"})
    stage, = build(env="guess", difficulty={"min_high": 64}, max_turns=3)
    assert stage.env.options == {"min_high": 64} and stage.limits == {"max_turns": 3}

    config = load_config(None, {"env": "arithmetic", "run_dir": str(tmp_path / "run"), "stages": ["eval", "rl"],
                                "curriculum": {"stages": [{"name": "s", "difficulty": {"max_operands": 3}}]}})
    with pytest.raises(ConfigError, match="max_operands"):
        run_pipeline(config, log=lambda line: None)
    assert not (tmp_path / "run" / "model").exists(), "refused before any stage ran"
    assert load_env("arithmetic").options == {}
