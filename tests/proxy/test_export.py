"""`trajlab traces export`: sessions recorded by a real server (tiny model, official SDK) back to trajectories."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from typer.testing import CliRunner

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import render
from trajlab.cli import app
from trajlab.config import ServeSettings
from trajlab.data.datasets import sft_dataset
from trajlab.data.store import read_trajectories
from trajlab.proxy import SessionRecorder, create_app
from trajlab.proxy.export import DropRule, export_sessions, load_reward, rebuild_session, session_files
from trajlab.proxy.recording import read_session
from trajlab.rollout.drift import TokenDriftError, check_token_drift

from .conftest import MODEL, running
from .test_app import WEATHER
from .test_tool_calls import CALL, FakeReplyGenerator

SYSTEM = "You answer with tools."
SUMMARY_SYSTEM = "Summarise the conversation in one line."


def always_solved(trajectory):
    """A reward function for the tests: every trajectory solved."""
    return 1.0, True


@pytest.fixture
def tool_server(tiny_tokenizer, tiny_template, tmp_path):
    """The real app, template and parser behind a scripted generator that always calls get_weather (the tiny model
    never calls a tool on its own); sessions are recorded in ``tmp_path``."""
    app = create_app(FakeReplyGenerator(tiny_tokenizer, CALL), tiny_tokenizer, tiny_template,
                     get_parser("auto", tiny_tokenizer), MODEL, SessionRecorder(tmp_path), ServeSettings(),
                     tiny_tokenizer.model_max_length)
    with running(app) as url:
        yield url


def message(response) -> dict:
    return response.choices[0].message.model_dump(exclude_none=True, exclude={"annotations", "audio", "refusal"})


class Agent:
    """Talks to one session through the official SDK, greedy, as an agent framework would."""

    def __init__(self, url: str, session: str, max_tokens: int = 8) -> None:
        self.api = OpenAI(base_url=f"{url}/sessions/{session}/v1", api_key="k", max_retries=0, timeout=60)
        self.max_tokens = max_tokens

    def call(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        response = self.api.chat.completions.create(model=MODEL, messages=messages, tools=tools or [WEATHER],
                                                    max_tokens=self.max_tokens, temperature=0, logprobs=True)
        return message(response)

    def summarise(self, messages: list[dict]) -> None:
        """An auxiliary call: another system prompt, no tools, its answer never enters the conversation."""
        text = "\n".join(str(m.get("content")) for m in messages)
        self.api.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": SUMMARY_SYSTEM}, {"role": "user", "content": text}])


def conversation(agent: Agent, first_user: str = "Weather in Paris?", summarise: bool = False) -> list[dict]:
    """Three calls: the model's reply, a tool result, another reply, a new user turn, a last reply."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_user}]
    messages.append(agent.call(messages))
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"})
    messages.append(agent.call(messages))
    if summarise:
        agent.summarise(messages)
    messages.append({"role": "user", "content": "And tomorrow?"})
    messages.append(agent.call(messages))
    return messages


def export(served, tmp_path, sessions, name="out.jsonl", **options):
    out = tmp_path / name
    summary = export_sessions(session_files(served.records, sessions), out, served.tokenizer, served.template,
                              **options)
    return summary, list(read_trajectories(out))


def test_a_multi_turn_session_exports_as_one_exact_trajectory(hf_server, tmp_path):
    messages = conversation(Agent(hf_server.url, "export-1"))
    summary, (trajectory,) = export(hf_server, tmp_path, ["export-1"])
    assert summary["calls"] == 3 and summary["samples"] == summary["written"] == 1
    assert trajectory.id == "export-1:0" and trajectory.task == {"session": "export-1", "sample": 0}
    assert trajectory.env == "recorded" and trajectory.policy == MODEL and trajectory.tools == [WEATHER]
    assert trajectory.metrics["turns"] == 3 and trajectory.metrics["template_match"] == 1.0

    tokenizer, tokens = hf_server.tokenizer, trajectory.tokens
    rendered = render(tokenizer, trajectory.messages, [WEATHER], chat_template=hf_server.template)
    assert tokenizer.decode(tokens.prompt_ids + tokens.completion_ids, skip_special_tokens=False) == rendered
    assert trajectory.messages[-1]["content"] == messages[-1]["content"]
    # Loss 1 exactly on each call's recorded completion, at the place its prompt ended; logprobs as recorded.
    records = list(read_session(hf_server.records / "export-1.jsonl"))
    assert tokens.prompt_ids == records[0]["prompts"][0]["token_ids"]
    expected_mask = [0] * len(tokens.completion_ids)
    for record in records:
        choice = record["choices"][0]
        start = len(record["prompts"][0]["token_ids"]) - len(tokens.prompt_ids)
        assert tokens.completion_ids[start:start + len(choice["token_ids"])] == choice["token_ids"]
        assert tokens.logprobs[start:start + len(choice["token_ids"])] == choice["logprobs"]
        expected_mask[start:start + len(choice["token_ids"])] = [1] * len(choice["token_ids"])
    assert tokens.loss_mask == expected_mask
    assert all(lp is None for lp, bit in zip(tokens.logprobs, tokens.loss_mask, strict=True) if not bit)
    assert len(tokens.completion_ids) == len(tokens.loss_mask) == len(tokens.logprobs)

    # The drift guard reads a recorded session as one conversation: it passes, and one altered token is caught.
    parser = get_parser("auto", tokenizer)
    assert check_token_drift([trajectory], tokenizer, hf_server.template, parser, max_drift=0.0) == ([trajectory], [])
    corrupted = trajectory.model_copy(deep=True)
    corrupted.tokens.completion_ids[-3] = corrupted.tokens.completion_ids[-3] - 1
    with pytest.raises(TokenDriftError, match="turn 3 \\(conversation\\)"):
        check_token_drift([corrupted], tokenizer, hf_server.template, parser, max_drift=0.0)


def test_an_edited_history_forks_and_sessions_never_mix(hf_server, tmp_path):
    agent = Agent(hf_server.url, "export-edit")
    first = conversation(agent)
    # The agent rewrites its history (an edited first question, the earlier turns kept): a fork, not a merge.
    edited = [first[0], {"role": "user", "content": "Weather in Rome?"}, *first[2:5]]
    agent.call(edited)
    conversation(Agent(hf_server.url, "export-other"))  # the same greedy conversation in another session
    summary, trajectories = export(hf_server, tmp_path, ["export-edit", "export-other"])
    assert [t.id for t in trajectories] == ["export-edit:0", "export-edit:1", "export-other:0"]
    assert [t.metrics["turns"] for t in trajectories] == [3, 1, 3]
    records = list(read_session(hf_server.records / "export-edit.jsonl"))
    fork = trajectories[1].tokens
    assert fork.prompt_ids == records[3]["prompts"][0]["token_ids"]  # its own prompt, whole: nothing borrowed
    assert fork.completion_ids[:len(records[3]["choices"][0]["token_ids"])] == records[3]["choices"][0]["token_ids"]
    assert "Weather in Rome?" in json.dumps(trajectories[1].messages)
    assert trajectories[0].tokens == trajectories[2].tokens  # identical, yet exported apart, each from its session


def test_auxiliary_calls_fork_or_are_dropped_by_a_rule(hf_server, tmp_path):
    conversation(Agent(hf_server.url, "export-aux"), summarise=True)
    summary, kept = export(hf_server, tmp_path, ["export-aux"], name="kept.jsonl")
    assert summary["calls"] == 4 and [t.metrics["turns"] for t in kept] == [3, 1]  # the main line still merges
    assert kept[1].messages[0]["content"] == SUMMARY_SYSTEM
    for rule in ("system=^Summarise", "tools=^$"):
        summary, (main,) = export(hf_server, tmp_path, ["export-aux"], name=f"{rule[:6]}.jsonl",
                                  drop=[DropRule.parse(rule)])
        assert summary["dropped"] == 1 and main.tokens == kept[0].tokens
    with pytest.raises(ValueError, match="KEY=REGEX"):
        DropRule.parse("prompt=x")


def test_the_stop_token_is_trained_and_the_template_newline_is_observation(tool_server, tiny_tokenizer,
                                                                           tiny_template, tmp_path):
    """Real tool calls (a scripted reply through the real app): the newline after <|im_end|> has loss 0."""
    agent = Agent(tool_server, "calls", max_tokens=64)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for result in ("sunny", "rainy"):
        reply = agent.call(messages)
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": result}]
    agent.call(messages)
    (sample,) = rebuild_session(read_session(tmp_path / "calls.jsonl"), "calls").samples
    out = tmp_path / "calls-out.jsonl"
    export_sessions([tmp_path / "calls.jsonl"], out, tiny_tokenizer, tiny_template)
    (trajectory,) = read_trajectories(out)
    tokens = trajectory.tokens
    assert trajectory.stop_reason == "tool_calls" and trajectory.metrics["tool_calls"] == 3
    assert trajectory.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tiny_tokenizer.decode(tokens.prompt_ids + tokens.completion_ids, skip_special_tokens=False) == render(
        tiny_tokenizer, trajectory.messages, [WEATHER], chat_template=tiny_template)
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tiny_tokenizer.encode("\n", add_special_tokens=False)
    ends = [i for i, (t, bit) in enumerate(zip(tokens.completion_ids, tokens.loss_mask, strict=True)) if t == end]
    assert len(ends) == 5  # three model stops (trained), two closing the tool results (not)
    trained_ends = [i for i in ends if tokens.loss_mask[i]]
    assert len(trained_ends) == 3
    for i in trained_ends:  # after each model stop: the template's newline, as observation (the last one closes)
        assert tokens.completion_ids[i + 1:i + 1 + len(newline)] == newline
        assert tokens.loss_mask[i + 1:i + 1 + len(newline)] == [0] * len(newline)
    assert len(sample.tokens.completion_ids) + len(newline) == len(tokens.completion_ids)


def test_n_choices_extend_with_one_and_fork_the_others(tool_server, tmp_path):
    api = OpenAI(base_url=f"{tool_server}/sessions/many/v1", api_key="k", max_retries=0)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=64)
    records = list(read_session(tmp_path / "many.jsonl"))
    assert len(rebuild_session(records, "many").samples) == 1
    samples = rebuild_session(records, "many", all_choices=True).samples
    assert len(samples) == 3 and {s.choice["index"] for s in samples} == {0, 1, 2}
    assert rebuild_session(records, "many", choice=5).samples == []


def test_reexport_is_idempotent_and_the_cli_output_trains_with_sft(hf_server, tiny_model_dir, tmp_path):
    conversation(Agent(hf_server.url, "export-sft"))
    out = tmp_path / "traces.jsonl"
    command = ["traces", "export", "--out", str(out), "--tokenizer", str(tiny_model_dir), "--record-dir",
               str(hf_server.records), "--session", "export-sft", "--reward", f"{__name__}:always_solved"]
    runner = CliRunner()
    first = runner.invoke(app, command)
    assert first.exit_code == 0, first.output
    assert "Exported 1 trajectories" in first.output
    before = out.read_bytes()
    again = runner.invoke(app, command)
    assert again.exit_code == 0 and "Exported 0 trajectories" in again.output and "1 already there" in again.output
    assert out.read_bytes() == before
    (trajectory,) = read_trajectories(out)
    assert (trajectory.status, trajectory.reward, trajectory.metrics["scored"]) == ("success", 1.0, 1.0)
    rows = sft_dataset([trajectory], include_failures=False, shortest_per_task=False)
    assert rows[0]["input_ids"] == trajectory.tokens.prompt_ids + trajectory.tokens.completion_ids
    trained = runner.invoke(app, ["sft", "--model", str(tiny_model_dir), "--from", str(out), "--out",
                                  str(tmp_path / "sft"), "--max-steps", "2", "--batch-size", "1"])
    assert trained.exit_code == 0, trained.output
    assert (tmp_path / "sft" / "final" / "config.json").is_file()


def test_unscored_trajectories_are_not_successes_and_bad_options_fail_clearly(hf_server, tiny_model_dir, tmp_path):
    conversation(Agent(hf_server.url, "export-unscored", max_tokens=3))
    _, (trajectory,) = export(hf_server, tmp_path, ["export-unscored"])
    assert (trajectory.status, trajectory.reward, trajectory.metrics["scored"]) == ("truncated", 0.0, 0.0)
    assert trajectory.stop_reason == "max_new_tokens"
    assert len(sft_dataset([trajectory], include_failures=False,
                           shortest_per_task=False)) == 0 and len(sft_dataset([trajectory], include_failures=True,
                                                                              shortest_per_task=False)) == 1
    with pytest.raises(ValueError, match="import path"):
        load_reward("no_colon")
    result = CliRunner().invoke(app, ["traces", "export", "--out", str(tmp_path / "x.jsonl"), "--tokenizer",
                                      str(tiny_model_dir), "--record-dir", str(hf_server.records), "--session",
                                      "no-such-session"])
    assert result.exit_code == 1 and "no recording" in result.output


def call(prompt, *completions, endpoint="/v1/chat/completions", status=200):
    """A call record with the fields the exporter reads; each completion is (token ids, finish reason)."""
    return {"schema": "trajlab.proxy.call/1", "request_id": f"r{len(prompt)}", "endpoint": endpoint,
            "status": status, "model": MODEL, "request": {"messages": [{"role": "user", "content": "x"}]},
            "prompts": [{"text": "", "token_ids": prompt}],
            "choices": [{"index": i, "prompt_index": 0, "token_ids": ids, "logprobs": [-0.5] * len(ids),
                         "finish_reason": "stop", "message": {"role": "assistant", "content": ""}, "parse_errors": []}
                        for i, ids in enumerate(completions)] if status == 200 else None}


def test_merge_rule_on_token_ids_alone():
    p = [1, 2, 3]
    records = [
        call(p, [10, 11], [20, 21]),                     # n=2: choice 0 and a fork for choice 1
        call(p + [20, 21, 5], [22]),                     # continues from choice 1: extends that fork
        call(p + [10, 11, 6, 7], [12]),                  # continues from choice 0
        call(p + [10, 11], [13], status=400),            # refused: skipped
        call(p + [10, 11, 6, 7, 12, 8], [14], endpoint="/v1/completions"),  # token-id prompt: same rule
        call(p, [30]),                                   # a retry from the start: a fork, tokens not mixed
        call([9] + p, [31]),                             # a rewritten head: a fork
    ]
    rebuilt = rebuild_session(records, "s", all_choices=True)
    assert rebuilt.skipped == 1 and rebuilt.calls == 6
    histories = [(s.tokens.prompt_ids, s.tokens.completion_ids, s.tokens.loss_mask) for s in rebuilt.samples]
    assert histories == [
        (p, [10, 11, 6, 7, 12, 8, 14], [1, 1, 0, 0, 1, 0, 1]),
        (p, [20, 21, 5, 22], [1, 1, 0, 1]),
        (p, [30], [1]),
        ([9] + p, [31], [1]),
    ]
    assert rebuilt.samples[1].tokens.logprobs == [-0.5, -0.5, None, -0.5]
    assert all(s.history == s.tokens.prompt_ids + s.tokens.completion_ids for s in rebuilt.samples)
    # Of two samples that both match, the longer history is extended.
    longer = rebuild_session([call(p, [4]), call(p + [4], [5]), call(p, [4]), call(p + [4, 5, 6], [7])], "s")
    assert [s.tokens.completion_ids for s in longer.samples] == [[4, 5, 6, 7], [4]]
