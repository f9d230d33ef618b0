"""The token-drift guard on real engine trajectories of the tiny model: clean records pass, one altered token is
caught in the prompt, a model turn and an observation, and a template other than the rollout's is named."""

import asyncio

import pytest

from tests.rollout.test_engine import call, make_engine
from trajlab.chat.parsers import get_parser
from trajlab.chat.template import ChatTemplate
from trajlab.env import load_env
from trajlab.inference.base import SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.rollout.drift import TokenDriftError, check_token_drift, find_drift
from trajlab.rollout.engine import make_engine as make_env_engine
from trajlab.rollout.runner import Episode

PARSER = get_parser("hermes")


def roll(engine, *tasks):
    episodes = [Episode(f"e{i}", task) for i, task in enumerate(tasks)]
    return sorted(asyncio.run(engine.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0)), key=lambda t: t.id)


@pytest.fixture(scope="module")
def flaky(tiny_tokenizer, tiny_template):
    """Tool errors of every kind, a malformed call, several turns, success."""
    texts = [call("boom", '{"x": 1}'), call("nope", "{}"),
             '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call><|im_end|>',
             'Thinking. ' + call("add", '{"a": 2, "b": 3}'), call("finish", "{}")]
    [trajectory] = roll(make_engine(tiny_tokenizer, tiny_template, texts, max_turns=10), {})
    assert trajectory.status == "success" and trajectory.metrics["parse_errors"] == 1
    return trajectory


@pytest.fixture(scope="module")
def engine_trajectories(tiny_model_dir, tiny_tokenizer, tiny_template, flaky):
    """Oracle episodes of two envs, the untrained model's own (garbage, unparsed, cut by the token limit), and a turn
    cut mid-way."""
    out = [flaky]
    for name in ("arithmetic", "guess"):
        env = load_env(name)
        tasks = [task for _, task in zip(range(3), env.iter_tasks("train", seed=0), strict=False)]
        oracle = ScriptedGenerator(env.oracle, tiny_tokenizer, tiny_template)
        out += roll(make_env_engine(env, oracle, tiny_tokenizer, chat_template=tiny_template,
                                    parser=get_parser("auto", tiny_tokenizer), seed=0), *tasks)
        sampled = HFGenerator(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=32)
        out += roll(make_env_engine(env, sampled, tiny_tokenizer, chat_template=tiny_template,
                                    parser=get_parser("auto", tiny_tokenizer), limits={"max_new_tokens": 24},
                                    sampling=SamplingParams(temperature=1.0), seed=0), *tasks)
    [cut] = roll(make_engine(tiny_tokenizer, tiny_template, [call("add", '{"a": 2, "b": 3}')] * 2,
                             max_new_tokens=6), {})
    assert cut.stop_reason == "max_new_tokens"
    return out + [cut]


def altered(trajectory, position):
    """A copy with the token at ``position`` of ``prompt_ids + completion_ids`` replaced by another."""
    copy = trajectory.model_copy(deep=True)
    tokens = copy.tokens
    ids = tokens.prompt_ids if position < len(tokens.prompt_ids) else tokens.completion_ids
    at = position if ids is tokens.prompt_ids else position - len(tokens.prompt_ids)
    ids[at] = ids[at] + 1 if ids[at] + 1 < 300 else ids[at] - 1
    return copy


def chat_for(trajectory, tokenizer, template):
    return ChatTemplate(tokenizer, trajectory.tools, template)


def test_engine_trajectories_have_no_drift(engine_trajectories, tiny_tokenizer, tiny_template):
    statuses = {t.status for t in engine_trajectories}
    assert {"success", "truncated"} <= statuses
    assert any(t.metrics.get("parse_errors") for t in engine_trajectories)
    kept, drifts = check_token_drift(engine_trajectories, tiny_tokenizer, tiny_template,
                                     get_parser("auto", tiny_tokenizer), max_drift=0.0)
    assert drifts == [] and kept == engine_trajectories


def test_one_altered_token_is_caught_where_it_is(flaky, tiny_tokenizer, tiny_template):
    chat = chat_for(flaky, tiny_tokenizer, tiny_template)
    tokens = flaky.tokens
    trained = [0] * len(tokens.prompt_ids) + tokens.loss_mask
    prompt = len(tokens.prompt_ids)
    model_turn_2 = [i for i in range(1, len(trained)) if trained[i] and not trained[i - 1]][1]
    observation_3 = [i for i in range(1, len(trained)) if not trained[i] and trained[i - 1]][2]
    for position, turn, segment in ((5, 0, "prompt"), (prompt - 2, 0, "prompt"), (model_turn_2 + 3, 2, "model"),
                                    (observation_3 + 2, 3, "observation")):
        drift = find_drift(altered(flaky, position), chat, PARSER)
        assert drift is not None, (position, segment)
        assert (drift.turn, drift.segment) == (turn, segment)
        if segment != "model":
            assert drift.position == position
        assert drift.expected != drift.found
    assert find_drift(flaky, chat, PARSER) is None


def test_the_guard_stops_above_the_threshold_and_drops_what_drifted(flaky, tiny_tokenizer, tiny_template):
    observation_1 = next(i for i in range(len(flaky.tokens.prompt_ids), len(flaky.tokens.prompt_ids) + 99)
                         if not flaky.tokens.loss_mask[i - len(flaky.tokens.prompt_ids)])
    bad = altered(flaky, observation_1).model_copy(update={"id": "bad"})
    batch = [flaky, bad, flaky.model_copy(update={"id": "ok2"}), flaky.model_copy(update={"id": "ok3"})]
    with pytest.raises(TokenDriftError, match=r"1 of 4 trajectories .*'bad', turn 1 \(observation\).*max_drift"):
        check_token_drift(batch, tiny_tokenizer, tiny_template, PARSER, max_drift=0.0)
    kept, drifts = check_token_drift(batch, tiny_tokenizer, tiny_template, PARSER, max_drift=0.25)
    assert [t.id for t in kept] == [flaky.id, "ok2", "ok3"] and [d.trajectory_id for d in drifts] == ["bad"]


def test_another_template_at_training_time_is_caught_and_named(flaky, tiny_tokenizer, tiny_template):
    other = tiny_template.replace("assistant\\n'", "assistant\\n\\n'")  # a blank line after each header
    assert other != tiny_template
    with pytest.raises(TokenDriftError, match="a template other than the tokenizer's own.*the prompt"):
        check_token_drift([flaky], tiny_tokenizer, other, PARSER, max_drift=0.0)


def test_a_model_turn_whose_message_was_edited_is_caught(flaky, tiny_tokenizer, tiny_template):
    edited = flaky.model_copy(deep=True)
    assistant = next(m for m in edited.messages if m["role"] == "assistant" and m.get("tool_calls"))
    assistant["tool_calls"][0]["function"]["arguments"] = {"x": 2}
    drift = find_drift(edited, chat_for(edited, tiny_tokenizer, tiny_template), PARSER)
    assert (drift.turn, drift.segment) == (1, "model")


def test_records_without_tokens_pass(flaky, tiny_tokenizer, tiny_template):
    text_only = flaky.model_copy(update={"tokens": None})
    assert find_drift(text_only, chat_for(flaky, tiny_tokenizer, tiny_template), PARSER) is None


def test_sft_refuses_drifted_demonstrations_before_training(flaky, tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    import trajlab
    from trajlab.cli import app
    from trajlab.data.store import TrajectoryStore
    from trajlab.rollout.drift import without_drift

    observation = flaky.tokens.loss_mask.index(0) + len(flaky.tokens.prompt_ids)
    demos = [flaky.model_copy(update={"id": f"ok{i}"}) for i in range(3)] + [
        altered(flaky, observation).model_copy(update={"id": "bad"})]
    assert [t.id for t in without_drift(demos, load_tokenizer(tiny_model_dir), parser="hermes", max_drift=0.25,
                                        processor=None)] == ["ok0", "ok1", "ok2"]
    with pytest.raises(TokenDriftError, match="1 of 4"):
        trajlab.sft(tiny_model_dir, demos, tmp_path / "api", parser="hermes", max_steps=1)
    path = tmp_path / "demos.jsonl"
    with TrajectoryStore(path) as store:
        for demo in demos:
            store.append(demo)
    result = CliRunner().invoke(app, ["sft", "--model", str(tiny_model_dir), "--from", str(path), "--out",
                                      str(tmp_path / "cli"), "--set", "rollout.parser=hermes"])
    assert result.exit_code == 1 and "Token drift in 1 of 4 trajectories" in result.stdout, result.stdout
    assert not (tmp_path / "cli" / "final").exists()
