"""An agent framework from PyPI (smolagents' ``ToolCallingAgent``) runs a tool-using task through the recording
server, and its recording exports to trajectories that ``trajlab sft`` trains on as they are.

The tiny model never writes a tool call, so the framework's tool loop is driven by ``FakeScriptGenerator`` (a
scripted fake behind the real app, template and parser: a calculator call, then smolagents' ``final_answer``); the
framework also runs once against the real tiny model, which must complete whatever the model says.
"""

from __future__ import annotations

import json

import pytest
from smolagents import OpenAIServerModel, ToolCallingAgent, tool
from typer.testing import CliRunner

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import render
from trajlab.cli import app
from trajlab.config import ServeSettings
from trajlab.data.datasets import sft_dataset
from trajlab.data.store import read_trajectories
from trajlab.proxy import SessionRecorder, create_app
from trajlab.proxy.export import export_sessions, session_files
from trajlab.proxy.recording import read_session
from trajlab.rollout.types import TokenRecord

from .conftest import MODEL, Served, running
from .test_tool_calls import FakeReplyGenerator

SESSION = "agent-1"
MULTIPLY = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'
ANSWER = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "42"}}\n</tool_call><|im_end|>'


class FakeScriptGenerator(FakeReplyGenerator):
    """Replies with ``replies`` in order, one per call (the last one repeated), as a model that uses tools would."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        super().__init__(tokenizer, replies[0])
        self.replies = replies

    async def generate(self, request):
        self.reply = self.replies[min(len(self.prompts), len(self.replies) - 1)]
        return await super().generate(request)


def calculator(calls: list[tuple[int, int]]):
    """A smolagents tool that records every call it executes in ``calls``."""

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        calls.append((a, b))
        return a * b

    return multiply


def agent(url: str, session: str, tools: list, max_steps: int, **sampling) -> ToolCallingAgent:
    """smolagents pointed at one session; it asks for ``tool_choice: "required"`` unless told otherwise, which the
    server refuses, so ``auto`` is set on the model."""
    model = OpenAIServerModel(MODEL, api_base=f"{url}/sessions/{session}/v1", api_key="k", tool_choice="auto",
                              client_kwargs={"max_retries": 0, "timeout": 120}, temperature=0, **sampling)
    return ToolCallingAgent(tools=tools, model=model, max_steps=max_steps, verbosity_level=0)


def answered_42(trajectory):
    """A reward for the tests: solved when the last reply calls ``final_answer`` with 42."""
    calls = trajectory.messages[-1].get("tool_calls") or []
    solved = [c["function"] for c in calls] == [{"name": "final_answer", "arguments": {"answer": "42"}}]
    return float(solved), solved


def assert_exact(trajectory, tokenizer, template) -> None:
    """The token invariant holds and the tokens decode to the template's rendering of the messages."""
    TokenRecord.model_validate(trajectory.tokens.model_dump())
    assert trajectory.metrics["template_match"] == 1.0
    tokens = trajectory.tokens
    rendered = render(tokenizer, trajectory.messages, trajectory.tools, chat_template=template)
    assert tokenizer.decode(tokens.prompt_ids + tokens.completion_ids, skip_special_tokens=False) == rendered


@pytest.fixture
def scripted_server(tiny_tokenizer, tiny_template, tmp_path):
    generator = FakeScriptGenerator(tiny_tokenizer, [MULTIPLY, ANSWER])
    records = tmp_path / "sessions"
    app_ = create_app(generator, tiny_tokenizer, tiny_template, get_parser("auto", tiny_tokenizer), MODEL,
                      SessionRecorder(records), ServeSettings(), tiny_tokenizer.model_max_length)
    with running(app_) as url:
        yield Served(url, records, tiny_tokenizer, tiny_template)


def test_a_smolagents_tool_loop_is_recorded_and_its_export_trains(scripted_server, tiny_model_dir, tmp_path):
    executed: list[tuple[int, int]] = []
    answer = agent(scripted_server.url, SESSION, [calculator(executed)], max_steps=3).run("What is 6 times 7?")
    assert answer == "42" and executed == [(6, 7)]  # the framework parsed the call and ran its tool

    # The recording: the framework's own tool schemas, then the result as the framework sends it back (smolagents
    # writes its tool call as assistant text and the result as a user "Observation" message, not OpenAI roles).
    first, second = read_session(scripted_server.records / f"{SESSION}.jsonl")
    assert first["status"] == second["status"] == 200 and first["session_source"] == "path"
    for record in (first, second):
        tools = {t["function"]["name"]: t["function"] for t in record["request"]["tools"]}
        assert set(tools) == {"multiply", "final_answer"}
        assert tools["multiply"]["parameters"]["properties"]["a"]["type"] == "integer"
    (call,) = first["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}
    resent = json.dumps(second["request"]["messages"][2:])
    assert call["id"] in resent and "'name': 'multiply'" in resent and "Observation:\\n42" in resent

    out = tmp_path / "traces.jsonl"
    runner = CliRunner()
    exported = runner.invoke(app, ["traces", "export", "--out", str(out), "--tokenizer", str(tiny_model_dir),
                                   "--record-dir", str(scripted_server.records), "--session", SESSION,
                                   "--reward", f"{__name__}:answered_42"])
    assert exported.exit_code == 0, exported.output
    # The resent history renders differently from the tokens the model wrote, so the second call forks.
    calling, answering = read_trajectories(out)
    assert [calling.id, answering.id] == [f"{SESSION}:0", f"{SESSION}:1"]
    for trajectory in (calling, answering):
        assert_exact(trajectory, scripted_server.tokenizer, scripted_server.template)
        assert trajectory.stop_reason == "tool_calls" and trajectory.metrics["turns"] == 1
    assert calling.messages[-1]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    assert (calling.status, calling.reward) == ("failure", 0.0)
    text = json.dumps(answering.messages)
    assert call["id"] in text and "Observation:\\n42" in text  # the tool call and its result, as context
    assert (answering.status, answering.reward) == ("success", 1.0)
    tokens = answering.tokens
    trained = [t for t, bit in zip(tokens.completion_ids, tokens.loss_mask, strict=True) if bit]
    assert scripted_server.tokenizer.decode(trained, skip_special_tokens=False) == ANSWER

    assert len(sft_dataset([calling, answering], include_failures=False,
                           shortest_per_task=False)) == 1  # only the scored success
    sft = runner.invoke(app, ["sft", "--model", str(tiny_model_dir), "--from", str(out), "--out",
                              str(tmp_path / "sft"), "--max-steps", "2", "--batch-size", "1"])
    assert sft.exit_code == 0, sft.output
    assert (tmp_path / "sft" / "final" / "config.json").is_file()


def test_the_agent_completes_against_the_real_tiny_model(hf_server, tmp_path):
    executed: list[tuple[int, int]] = []
    runner = agent(hf_server.url, "agent-real", [calculator(executed)], max_steps=1, max_tokens=8)
    assert isinstance(runner.run("What is 6 times 7?"), str)  # whatever the model says, the run ends
    records = list(read_session(hf_server.records / "agent-real.jsonl"))
    assert records and all(r["status"] == 200 for r in records)
    assert {t["function"]["name"] for t in records[0]["request"]["tools"]} == {"multiply", "final_answer"}

    out = tmp_path / "real.jsonl"
    summary = export_sessions(session_files(hf_server.records, ["agent-real"]), out, hf_server.tokenizer,
                              hf_server.template)
    trajectories = list(read_trajectories(out))
    assert summary["calls"] == len(records) and len(trajectories) >= 1
    for trajectory in trajectories:
        assert_exact(trajectory, hf_server.tokenizer, hf_server.template)
        assert any(trajectory.tokens.loss_mask)
