"""The GEPA adapter contract, an optimisation that measurably helps, resume, and a real tiny reflection model.

The optimisation tests use the test-only scripted parts of ``tests/evolution/scripted.py``, named for what they are: a
policy that makes a characteristic mistake unless its system prompt tells it to double-check, and a deterministic
reflection "LM" that adds that instruction when the feedback shows wrong answers. Neither ships with trajlab.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.evolution.scripted import HINT, SEED_PROMPT, InstructionFollowingPolicy, deterministic_proposer
from trajlab.chat.parsers import get_parser
from trajlab.config import EvolveSettings, RolloutSettings
from trajlab.data.store import read_trajectories
from trajlab.env.builtin.arithmetic import SPEC as ARITHMETIC
from trajlab.env.builtin.arithmetic import oracle
from trajlab.env.prompts import SYSTEM_PROMPT as COMPONENT
from trajlab.env.registry import EnvSpec
from trajlab.evolution.adapter import TrajlabAdapter
from trajlab.evolution.candidate import seed_candidate
from trajlab.evolution.reflection import LocalReflection
from trajlab.evolution.search import run_evolve
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.types import task_id


def tasks(split: str, n: int, skip: int = 0) -> list[dict[str, Any]]:
    return list(itertools.islice(ARITHMETIC.iter_tasks(split, 0), skip, skip + n))


def make_adapter(tokenizer, template, policy=oracle, env: EnvSpec = ARITHMETIC) -> TrajlabAdapter:
    generator = ScriptedGenerator(policy, tokenizer, template, name="scripted")
    engine = RolloutEngine(env, generator, tokenizer, chat_template=template, parser=get_parser("auto", tokenizer),
                           limits=dict(max_turns=4), seed=0)
    return TrajlabAdapter(engine, weights=None, rollout=RolloutSettings())


def test_adapter_contract(tiny_tokenizer, tiny_template):
    adapter = make_adapter(tiny_tokenizer, tiny_template)
    batch = tasks("train", 3)
    result = adapter.evaluate(batch, {COMPONENT: SEED_PROMPT}, capture_traces=True)
    assert len(result.outputs) == len(result.scores) == len(result.trajectories) == len(batch)
    assert result.scores == [1.0, 1.0, 1.0]
    assert adapter.evaluate(batch, {COMPONENT: SEED_PROMPT}).trajectories is None
    dataset = adapter.make_reflective_dataset({COMPONENT: SEED_PROMPT}, result, [COMPONENT])
    records = dataset[COMPONENT]
    assert len(records) == 3 and all(set(r) == {"Inputs", "Generated Outputs", "Feedback"} for r in records)
    assert records[0]["Inputs"] == batch[0]["question"]
    shown = records[0]["Generated Outputs"]
    assert "call submit(" in shown and "-> submit: Correct." in shown
    assert "score 1.00 (success" in records[0]["Feedback"] and "progress 1.00" in records[0]["Feedback"]
    assert hasattr(adapter, "propose_new_texts") and adapter.propose_new_texts is None


def test_failing_episode_scores_zero_with_its_error(tiny_tokenizer, tiny_template):
    adapter = make_adapter(tiny_tokenizer, tiny_template)
    batch = [tasks("train", 1)[0], {"task_id": "broken", "question": "no operands"}]  # reset raises KeyError
    result = adapter.evaluate(batch, {COMPONENT: SEED_PROMPT}, capture_traces=True)
    assert result.scores == [1.0, 0.0]
    assert result.outputs[1]["status"] == "error" and "KeyError" in result.outputs[1]["error"]
    broken = result.trajectories[1]
    assert "KeyError" in broken["transcript"] and "error: KeyError" in broken["feedback"]
    assert "no operands" in result.trajectories[1]["task"]


def test_a_task_without_an_id_is_named_by_its_content_hash(tiny_tokenizer, tiny_template, tmp_path: Path):
    adapter = make_adapter(tiny_tokenizer, tiny_template)
    task = {key: value for key, value in tasks("train", 1)[0].items() if key != "task_id"}
    reordered = dict(reversed(task.items()))
    with adapter.recording(tmp_path / "rollouts.jsonl"):
        result = adapter.evaluate([task, reordered], {COMPONENT: SEED_PROMPT})
    assert result.scores == [1.0, 1.0]
    assert [output["task_id"] for output in result.outputs] == [task_id(task)] * 2
    assert task_id(task).startswith("task-")
    # the same row in another key order is the same task: one episode, named by the task's id
    assert [t.id.endswith(f":{task_id(task)}") for t in read_trajectories(tmp_path / "rollouts.jsonl")] == [True]
    assert adapter.rollouts == 1


def test_evolution_raises_the_held_out_score(tiny_tokenizer, tiny_template, tmp_path: Path):
    adapter = make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy())
    summary = run_evolve(adapter, deterministic_proposer, tasks("train", 4), tasks("train", 4, skip=4),
                         seed_candidate={COMPONENT: SEED_PROMPT}, out=tmp_path,
                         settings=EvolveSettings(max_metric_calls=20), seed=0)
    result = tmp_path / "result"
    best = (result / "best_prompt.txt").read_text()
    assert HINT in best and summary["best_val_score"] == 1.0 and summary["seed_val_score"] == 0.0
    assert summary["rollouts"] == adapter.rollouts <= summary["metric_calls"] <= 20 + 10  # + at most one iteration
    candidates = json.loads((result / "candidates.json").read_text())
    assert candidates[0]["texts"] == {COMPONENT: SEED_PROMPT} and candidates[0]["parents"] == []
    assert candidates[summary["best_index"]]["parents"] == [0]
    assert json.loads((result / "summary.json").read_text()) == summary

    held_out = tasks("test", 8)
    seed_score = sum(adapter.evaluate(held_out, {COMPONENT: SEED_PROMPT}).scores) / len(held_out)
    best_score = sum(adapter.evaluate(held_out, {COMPONENT: best}).scores) / len(held_out)
    assert (seed_score, best_score) == (0.0, 1.0)


def test_a_resumed_run_continues_without_rescoring_the_seed(tiny_tokenizer, tiny_template, tmp_path: Path):
    adapter = make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy())
    train, val = tasks("train", 4), tasks("train", 4, skip=4)
    first = run_evolve(adapter, deterministic_proposer, train, val, seed_candidate={COMPONENT: SEED_PROMPT},
                       out=tmp_path, settings=EvolveSettings(max_metric_calls=4), seed=0)
    assert first["rollouts"] == 4 and first["candidates"] == 1 and not first["resumed"]
    fresh = make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy())
    second = run_evolve(fresh, deterministic_proposer, train, val, seed_candidate={COMPONENT: SEED_PROMPT},
                        out=tmp_path, settings=EvolveSettings(max_metric_calls=20), seed=0)
    assert second["resumed"] and second["candidates"] > 1
    assert second["rollouts"] == 4 + fresh.rollouts == 4 + second["rollouts_this_run"]  # the seed's 4 not run again
    with pytest.raises(ValueError, match="different seed_candidate"):
        run_evolve(fresh, deterministic_proposer, train, val, seed_candidate={COMPONENT: "Another prompt."},
                   out=tmp_path, settings=EvolveSettings(max_metric_calls=30), seed=0)


class Interrupted(BaseException):
    """Stands in for Ctrl-C or a killed job: not an Exception, so no episode swallows it."""


class CrashingOnce(InstructionFollowingPolicy):
    """TEST-ONLY: the instruction-following policy, interrupted the first time it plays ``crash_task`` with the hint."""

    def __init__(self, crash_task: str) -> None:
        self.crash_task, self.crashed = crash_task, False

    def __call__(self, task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        if task["task_id"] == self.crash_task and HINT in messages[0]["content"] and not self.crashed:
            self.crashed = True
            raise Interrupted
        return super().__call__(task, messages)


def test_an_interrupted_iteration_resumes_without_repeating_finished_episodes(
    tiny_tokenizer, tiny_template, tmp_path: Path
):
    train, val = tasks("train", 4), tasks("train", 4, skip=4)
    kwargs = {"seed_candidate": {COMPONENT: SEED_PROMPT}, "settings": EvolveSettings(max_metric_calls=20), "seed": 0}
    reference = run_evolve(make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy()),
                           deterministic_proposer, train, val, out=tmp_path / "reference", **kwargs)

    crashing = make_adapter(tiny_tokenizer, tiny_template, policy=CrashingOnce(val[2]["task_id"]))
    # one episode at a time: val[0] and val[1] finish before val[2] is interrupted
    crashing.rollout = RolloutSettings(concurrency=1)
    with pytest.raises(Interrupted):
        run_evolve(crashing, deterministic_proposer, train, val, out=tmp_path / "run", **kwargs)
    stored = [json.loads(line)["id"] for line in (tmp_path / "run" / "gepa" / "rollouts.jsonl").open()]
    assert len(stored) == crashing.rollouts > 4  # the seed's validation and the cut iteration's finished episodes

    resumed = make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy())
    summary = run_evolve(resumed, deterministic_proposer, train, val, out=tmp_path / "run", **kwargs)
    assert summary["rollouts_this_run"] == resumed.rollouts == reference["rollouts"] - len(stored)
    assert summary["rollouts"] == reference["rollouts"]  # no finished episode was rolled out twice
    assert (summary["best_val_score"], summary["candidates"]) == (reference["best_val_score"],
                                                                 reference["candidates"])


def test_tool_descriptions_evolve_with_the_system_prompt(tiny_tokenizer, tiny_template, tmp_path: Path):
    adapter = make_adapter(tiny_tokenizer, tiny_template)
    candidate = seed_candidate(ARITHMETIC, SEED_PROMPT, ["submit"])
    assert candidate == {COMPONENT: SEED_PROMPT, "tool:submit": ARITHMETIC.tools[2]["function"]["description"]}
    with adapter.recording(tmp_path / "rollouts.jsonl"):
        adapter.evaluate(tasks("train", 1), {**candidate, "tool:submit": "Hand in the FINAL-ANSWER-XYZ."})
    (shown,) = read_trajectories(tmp_path / "rollouts.jsonl")
    prompt = tiny_tokenizer.decode(shown.tokens.prompt_ids)
    assert "Hand in the FINAL-ANSWER-XYZ." in prompt and SEED_PROMPT in prompt

    asked: list[str] = []

    def proposer(prompt: str) -> str:
        asked.append(prompt)
        return deterministic_proposer(prompt)

    stubborn = InstructionFollowingPolicy()
    stubborn.hint = "never in any prompt"  # always wrong: every iteration reflects, on each text in turn
    summary = run_evolve(make_adapter(tiny_tokenizer, tiny_template, policy=stubborn), proposer,
                         tasks("train", 3), tasks("train", 3, skip=3), seed_candidate=candidate, out=tmp_path / "run",
                         settings=EvolveSettings(max_metric_calls=20), seed=0)
    assert summary["evolved"] == [COMPONENT, "tool:submit"]
    assert any("description it reads of the tool `submit`" in prompt for prompt in asked)  # the tool template
    best = json.loads((tmp_path / "run" / "result" / "best_candidate.json").read_text())
    assert set(best) == {COMPONENT, "tool:submit"}
    with pytest.raises(ValueError, match="no tool"):
        seed_candidate(ARITHMETIC, SEED_PROMPT, ["divide"])


def test_a_local_model_reflects(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path: Path):
    adapter = make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy())
    reflection = LocalReflection(tiny_model_dir, max_new_tokens=32, temperature=1.0, device="cpu", dtype="auto")
    assert isinstance(reflection("Improve this prompt."), str)
    summary = run_evolve(adapter, reflection, tasks("train", 3), tasks("train", 2, skip=3),
                         seed_candidate={COMPONENT: SEED_PROMPT}, out=tmp_path,
                         settings=EvolveSettings(max_metric_calls=8), seed=0)
    assert summary["rollouts"] >= 2 and (tmp_path / "result" / "best_prompt.txt").exists()
    assert (tmp_path / "gepa" / "gepa_state.bin").exists()
