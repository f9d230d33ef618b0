"""The GEPA adapter contract, an optimisation that measurably helps, resume, and a real tiny reflection model.

The optimisation test uses two test-only scripted parts, named for what they are: ``InstructionFollowingPolicy``,
an arithmetic policy that makes a characteristic mistake unless its system prompt tells it to double-check, and
``deterministic_proposer``, a reflection "LM" that reads GEPA's reflection prompt and appends that instruction when
the feedback shows wrong final answers. Neither ships with trajlab.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from trajlab.chat.parsers import get_parser
from trajlab.env.builtin.arithmetic import SPEC as ARITHMETIC
from trajlab.env.builtin.arithmetic import oracle
from trajlab.env.registry import EnvSpec
from trajlab.evolve.adapter import COMPONENT, TrajlabAdapter
from trajlab.evolve.reflection import LocalReflection
from trajlab.evolve.run import run_evolve
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.rollout.engine import RolloutLimits

SEED_PROMPT = "You solve arithmetic with the calculator tools."
HINT = "Double-check: submit exactly the last tool result."


def tasks(split: str, n: int, skip: int = 0) -> list[dict[str, Any]]:
    return list(itertools.islice(ARITHMETIC.iter_tasks(split, 0), skip, skip + n))


def make_adapter(tokenizer, template, policy=oracle, env: EnvSpec = ARITHMETIC) -> TrajlabAdapter:
    generator = ScriptedGenerator(policy, tokenizer, template, name="scripted")
    return TrajlabAdapter(env, generator, tokenizer, chat_template=template, parser=get_parser("auto", tokenizer),
                          limits=RolloutLimits(max_turns=4))


class InstructionFollowingPolicy:
    """TEST-ONLY scripted policy: solves like the oracle but, unless told to double-check, submits the result + 1."""

    def __call__(self, task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        message = oracle(task, messages)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        call = message["tool_calls"][0]["function"]
        if call["name"] == "submit" and "double-check" not in system.lower():
            call["arguments"] = {"answer": call["arguments"]["answer"] + 1}
        return message


def deterministic_proposer(prompt: str) -> str:
    """TEST-ONLY reflection LM: reads GEPA's reflection prompt and fixes the prompt when submits were wrong."""
    current = prompt.split("```")[1].strip()  # GEPA's template puts the current instruction in the first block
    if "-> submit: Wrong." in prompt and HINT not in current:
        return f"```\n{current} {HINT}\n```"
    return f"```\n{current}\n```"


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


def test_evolution_raises_the_held_out_score(tiny_tokenizer, tiny_template, tmp_path: Path):
    adapter = make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy())
    summary = run_evolve(adapter, deterministic_proposer, tasks("train", 4), tasks("train", 4, skip=4),
                         seed_prompt=SEED_PROMPT, out=tmp_path, max_metric_calls=20)
    result = tmp_path / "result"
    best = (result / "best_prompt.txt").read_text()
    assert HINT in best and summary["best_val_score"] == 1.0 and summary["seed_val_score"] == 0.0
    assert summary["rollouts"] <= 20 + 4 and summary["rollouts"] == adapter.rollouts  # one metric call = one rollout
    candidates = json.loads((result / "candidates.json").read_text())
    assert candidates[0][COMPONENT] == SEED_PROMPT and candidates[0]["parents"] == []
    assert candidates[summary["best_index"]]["parents"] == [0]
    assert json.loads((result / "summary.json").read_text()) == summary

    held_out = tasks("test", 8)
    seed_score = sum(adapter.evaluate(held_out, {COMPONENT: SEED_PROMPT}).scores) / len(held_out)
    best_score = sum(adapter.evaluate(held_out, {COMPONENT: best}).scores) / len(held_out)
    assert (seed_score, best_score) == (0.0, 1.0)


def test_an_interrupted_run_resumes_without_rescoring_the_seed(tiny_tokenizer, tiny_template, tmp_path: Path):
    adapter = make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy())
    train, val = tasks("train", 4), tasks("train", 4, skip=4)
    first = run_evolve(adapter, deterministic_proposer, train, val, seed_prompt=SEED_PROMPT, out=tmp_path,
                       max_metric_calls=4)
    assert first["rollouts"] == 4 and first["candidates"] == 1 and not first["resumed"]
    adapter.rollouts = 0
    second = run_evolve(adapter, deterministic_proposer, train, val, seed_prompt=SEED_PROMPT, out=tmp_path,
                        max_metric_calls=20)
    assert second["resumed"] and second["candidates"] > 1
    assert second["rollouts"] == 4 + adapter.rollouts  # the seed's 4 validation rollouts were not run again
    with pytest.raises(ValueError, match="different seed_prompt"):
        run_evolve(adapter, deterministic_proposer, train, val, seed_prompt="Another prompt.", out=tmp_path,
                   max_metric_calls=30)


@pytest.mark.slow
def test_a_local_model_reflects(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path: Path):
    adapter = make_adapter(tiny_tokenizer, tiny_template, policy=InstructionFollowingPolicy())
    reflection = LocalReflection(tiny_model_dir, max_new_tokens=32, temperature=1.0)
    assert isinstance(reflection("Improve this prompt."), str)
    summary = run_evolve(adapter, reflection, tasks("train", 3), tasks("train", 2, skip=3),
                         seed_prompt=SEED_PROMPT, out=tmp_path, max_metric_calls=8)
    assert summary["rollouts"] >= 2 and (tmp_path / "result" / "best_prompt.txt").exists()
    assert (tmp_path / "gepa" / "gepa_state.bin").exists()
