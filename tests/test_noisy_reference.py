"""The noisy reference policy (``collect.reference_noise``): plausible wrong calls from the tool schemas, the same in
the same situation, at about the asked rate, in token-exact trajectories that say which demonstrations are noisy."""

import json
import random
from collections import defaultdict

import pytest
from typer.testing import CliRunner

import trajlab
from trajlab.cli import app
from trajlab.collection.demonstrators import demonstrator
from trajlab.collection.plan import episode_tag, plan_episodes
from trajlab.config import ConfigError, load_config
from trajlab.env.base import tool_call_message
from trajlab.env.noisy import NoisyReference, wrong_call
from trajlab.env.registry import load_env
from trajlab.errors import UserError
from trajlab.models.loading import load_tokenizer
from trajlab.models.tiny import ensure_default_model
from trajlab.rollout.drift import without_drift

TOOLS = [
    {"type": "function", "function": {"name": "move", "parameters": {"type": "object", "properties": {
        "steps": {"type": "integer"}, "side": {"type": "string", "enum": ["left", "right"]},
        "fast": {"type": "boolean"}, "note": {"type": "string"}}, "required": ["steps", "side"]}}},
    {"type": "function", "function": {"name": "wait", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "say", "parameters": {"type": "object", "properties": {
        "words": {"type": "string"}, "times": {"type": "integer"}}, "required": ["words", "times"]}}},
]


def _call(message):
    function = message["tool_calls"][0]["function"]
    return function["name"], function["arguments"]


def test_a_wrong_call_changes_one_argument_plausibly_or_calls_another_tool_with_typed_arguments():
    given = {"steps": 5, "side": "left", "fast": True, "note": "ab"}
    seen = defaultdict(set)
    for seed in range(200):
        name, arguments = _call(wrong_call(tool_call_message("move", given), TOOLS, random.Random(seed)))
        if name == "move":
            changed = {key for key in given if arguments[key] != given[key]}
            assert len(changed) == 1, arguments
            key = changed.pop()
            seen["move"].add(key)
            assert {"steps": 1 <= abs(arguments["steps"] - 5) <= 3, "side": arguments["side"] == "right",
                    "fast": arguments["fast"] is False, "note": arguments["note"] == "ba"}[key]
        elif name == "say":  # the reference's values of the right type: one of its strings, its integer
            seen["say"].add(arguments["words"])
            assert arguments["words"] in ("left", "ab") and arguments["times"] == 5
        else:
            seen["wait"].add(json.dumps(arguments))
            assert (name, arguments) == ("wait", {})
    assert seen["move"] == {"steps", "side", "fast", "note"} and seen["say"] == {"left", "ab"} and seen["wait"]
    # nothing to do instead: no call, or the only tool and no arguments
    assert wrong_call({"role": "assistant", "content": "done"}, TOOLS, random.Random(0)) is None
    assert wrong_call(tool_call_message("wait", {}), TOOLS[1:2], random.Random(0)) is None


def test_the_noisy_reference_errs_the_same_way_in_the_same_situation_and_never_at_zero():
    spec = load_env("guess")
    noisy = NoisyReference(spec.oracle, lambda task: spec.tools, 0.5, seed=3)
    start = [{"role": "system", "content": "s"}, {"role": "user", "content": "I picked an integer between 1 and 100."}]
    task = {"low": 1, "high": 100, "secret": 7, "max_guesses": 8}
    first = noisy(task, start)
    assert all(noisy(dict(task, secret=secret), start) == first for secret in range(1, 100))  # the task is unseen
    answers = {_call(NoisyReference(spec.oracle, lambda task: spec.tools, 0.5, seed=seed)(task, start))[1]["n"]
               for seed in range(40)}
    assert 50 in answers and len(answers) > 2  # other seeds, other blind spots
    clean = NoisyReference(spec.oracle, lambda task: spec.tools, 0.0, seed=0)
    assert all(_call(clean(task, start + [{"role": "user", "content": str(i)}]))[1] == {"n": 50} for i in range(50))
    with pytest.raises(ValueError, match="from 0 to 1"):
        NoisyReference(spec.oracle, lambda task: spec.tools, 1.5, seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_default_model())


def test_noisy_demonstrations_are_reproducible_token_exact_marked_and_at_about_the_rate(tmp_path, tokenizer):
    spec = load_env("arithmetic")  # every task's conversation is its own: mistakes fall on turns at random
    noisy = trajlab.collect(spec, "oracle", out=tmp_path / "a.jsonl", episodes=200, reference_noise=0.3, seed=1,
                        tokenizer=tokenizer)
    again = trajlab.collect(spec, "oracle", out=tmp_path / "b.jsonl", episodes=200, reference_noise=0.3, seed=1,
                        tokenizer=tokenizer)
    assert [t.tokens for t in noisy] == [t.tokens for t in again]
    # the chat template's own tokens, turn by turn
    assert len(without_drift(noisy, tokenizer, parser="auto", max_drift=0.0, processor=None)) == len(noisy)

    assert [t.status for t in noisy if t.status == "error"] == [], "the oracle goes on from any mistake"
    erred = turns = 0
    for trajectory in noisy:
        assert trajectory.policy == "oracle+noise0.3" and trajectory.metrics["reference_noise"] == 0.3
        assert trajectory.id.endswith(":noise-0.3")
        # the record says exactly which turns the reference's own call would have been another
        messages = trajectory.messages
        mistakes = sum(_call(spec.oracle(trajectory.task, messages[:i])) != _call(message)
                       for i, message in enumerate(messages) if message["role"] == "assistant")
        assert trajectory.metrics["reference_noise/turns"] == mistakes
        erred, turns = erred + mistakes, turns + trajectory.metrics["turns"]
    assert 0.22 < erred / turns < 0.38
    # a wrong step almost always costs the answer: about 0.7 ** 3 of the episodes succeed
    assert 0.25 < sum(t.status == "success" for t in noisy) / len(noisy) < 0.45

    other_seed = trajlab.collect(spec, "oracle", out=tmp_path / "c.jsonl", episodes=50, reference_noise=0.3, seed=2,
                             tokenizer=tokenizer)
    assert [t.metrics["reference_noise/turns"] for t in other_seed] != [
        t.metrics["reference_noise/turns"] for t in noisy[:50]]
    clean = trajlab.collect(spec, "oracle", out=tmp_path / "a.jsonl", episodes=20, seed=1, tokenizer=tokenizer)
    assert all(t.policy == "oracle" and "reference_noise" not in t.metrics and t.status == "success" for t in clean)


def test_noise_is_for_the_oracle_and_at_most_one(tmp_path):
    spec = load_env("arithmetic")
    with pytest.raises(UserError, match="needs --policy oracle"):
        demonstrator(spec, str(tmp_path), reference=None, noise=0.2, seed=0)

    def plan(noise):
        return plan_episodes(spec, split="train", seed=0, episodes=2, samples_per_task=1, tasks=None,
                             tag=episode_tag(spec, None, None, noise))

    assert [e.id + ":noise-0.2" for e in plan(0.0)] == [e.id for e in plan(0.2)]
    with pytest.raises(ConfigError, match="collect.reference_noise"):
        load_config(None, {"collect": {"reference_noise": 1.5}})


def test_trajlab_collect_takes_reference_noise(tmp_path):
    out = tmp_path / "demos.jsonl"
    result = CliRunner().invoke(app, ["collect", "--env", "driving", "--policy", "oracle", "--episodes", "6",
                                      "--reference-noise", "1", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6
    assert all(r["policy"] == "oracle+noise1" and r["metrics"]["reference_noise/turns"] >= 1 for r in records)
    assert all(r["messages"][2]["tool_calls"][0]["function"]["name"] != "observe" for r in records)  # never looks
