"""``env: mcp`` against real MCP servers: the SDK-built one of ``mcp_servers.py`` over stdio in the sandbox and over
streamable HTTP on loopback, a hand-written one that breaks the protocol, and episodes through the real engine."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.env.reachable import reachable
from tests.rollout.test_engine import ReplayText, call, check_tokens
from trajlab.chat.parsers import get_parser
from trajlab.config import ConfigError, McpSettings, load_config
from trajlab.env.base import EnvHandle
from trajlab.env.content import tool_content
from trajlab.env.mcp_client import McpToolError
from trajlab.errors import InfrastructureError, UserError
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode

SITE = reachable(sysconfig.get_paths()["purelib"])  # the venv's packages: the servers' mcp and PIL
HERE = reachable(str(Path(__file__).resolve().parent))
SERVER = f"{HERE}/mcp_servers.py"


def stdio(*args: str, **settings) -> McpSettings:
    """Settings running ``mcp_servers.py ARGS`` in the sandbox with the system Python and the venv's packages."""
    return McpSettings(command=["/usr/bin/python3", SERVER, *args], env={"PYTHONPATH": SITE},
                       read_only_paths=[SITE, HERE], **settings)


@pytest.fixture(scope="module")
def per_episode():
    return stdio("sdk", "stdio").spec()


@pytest.fixture(scope="module")
def shared():
    spec = stdio("sdk", "stdio", server="shared", call_timeout_s=3).spec()
    yield spec
    spec.env_cls.server.close()


def opened(spec, task=None):
    env = EnvHandle(spec.make())
    env.reset(task or {"prompt": "go"})
    return env


def test_tools_schemas_and_descriptions_come_from_tools_list(per_episode):
    tools = {schema["function"]["name"]: schema["function"] for schema in per_episode.tools}
    assert sorted(tools) == ["add", "bump", "die", "fail", "hang", "pid", "red_square", "restart_count", "whoami"]
    assert tools["add"]["description"] == "Add two integers."
    assert tools["add"]["parameters"]["properties"] == {"a": {"title": "A", "type": "integer"},
                                                        "b": {"title": "B", "type": "integer"}}
    assert tools["add"]["parameters"]["required"] == ["a", "b"]
    assert per_episode.description.startswith(f"Tools served by the MCP server /usr/bin/python3 {SERVER}")


def test_text_image_and_error_results_become_observations(per_episode):
    env = opened(per_episode)
    try:
        assert env.tool("add")(a=2, b=3) == "5"
        image = tool_content(env.tool("red_square")())
        assert image[0]["type"] == "image" and image[0]["image"].getpixel((1, 1)) == (255, 0, 0)
        with pytest.raises(McpToolError, match="Error executing tool fail"):  # an isError result
            env.tool("fail")(reason="nope")
        with pytest.raises(McpToolError, match="validation error"):  # the server rejects the arguments
            env.tool("add")(a="x")
    finally:
        env.close()


def test_a_stdio_server_runs_in_the_sandbox(per_episode):
    env = opened(per_episode)
    try:
        uid, host = env.tool("whoami")().split()
    finally:
        env.close()
    assert host == "sandbox" and int(uid) != os.getuid()


def test_each_episode_gets_a_fresh_server_or_shares_one(per_episode, shared):
    counts = []
    for spec in (per_episode, per_episode, shared, shared):
        env = opened(spec)
        counts.append(env.tool("bump")())
        env.close()
    assert counts[:2] == ["1", "1"] and int(counts[3]) == int(counts[2]) + 1


def test_a_shared_server_calls_its_reset_tool_at_each_episode():
    spec = stdio("sdk", "stdio", server="shared", reset_tool="restart_count").spec()
    try:
        counts = []
        for _ in range(2):
            env = opened(spec)
            counts += [env.tool("bump")(), env.tool("bump")()]
            env.close()
        assert counts == ["1", "2", "1", "2"]
    finally:
        spec.env_cls.server.close()


def test_a_hung_or_dead_shared_server_is_an_infrastructure_error_and_restarted(shared):
    restarts = shared.env_cls.server.restarts
    env = opened(shared)
    env.tool("bump")()
    with pytest.raises(InfrastructureError, match="did not answer tools/call 'hang' within 3 s"):
        env.tool("hang")(seconds=30)
    env.close()
    env = opened(shared)
    assert env.tool("bump")() == "1", "a new server"
    with pytest.raises(InfrastructureError, match="closed the connection during tools/call 'die'"):
        env.tool("die")()
    with pytest.raises(InfrastructureError, match="is not running"):
        env.tool("bump")()
    env.close()
    env = opened(shared)
    assert env.tool("bump")() == "1" and shared.env_cls.server.restarts == restarts + 2
    env.close()


def engine(spec, tokenizer, template, texts):
    return RolloutEngine(spec, ReplayText(tokenizer, texts), tokenizer, chat_template=template,
                         parser=get_parser("hermes"), seed=0)


def test_an_episode_is_token_exact_and_rewarded_by_its_answer(per_episode, tiny_tokenizer, tiny_template):
    texts = [call("add", '{"a": 2, "b": 3}'), "The answer is 5<|im_end|>", "5.<|im_end|>"]
    task = {"prompt": "What is 2 + 3?", "answer": "5"}
    with engine(per_episode, tiny_tokenizer, tiny_template, texts[:2]) as wrong:
        missed = asyncio.run(wrong.run_episode(Episode("e0", task)))
    with engine(per_episode, tiny_tokenizer, tiny_template, [texts[0], texts[2]]) as right:
        solved = asyncio.run(right.run_episode(Episode("e1", task)))
    assert solved.status == "success" and solved.reward == 1.0
    assert solved.messages[2]["content"] == "5" and solved.messages[0]["content"] == "What is 2 + 3?"
    assert missed.status == "failure" and missed.reward == 0.0, "an answer is the whole final turn, not a part of it"
    check_tokens(solved, tiny_tokenizer, tiny_template)


def test_a_server_that_dies_mid_episode_ends_it_as_error_not_a_crash(per_episode, tiny_tokenizer, tiny_template):
    texts = [call("die", "{}"), call("add", '{"a": 1, "b": 1}'), "2<|im_end|>"]
    with engine(per_episode, tiny_tokenizer, tiny_template, texts) as broken:
        died = asyncio.run(broken.run_episode(Episode("e0", {"prompt": "go", "answer": "2"})))
    assert died.status == "error" and "closed the connection during tools/call 'die'" in died.error
    with engine(per_episode, tiny_tokenizer, tiny_template, texts[1:]) as fresh:
        after = asyncio.run(fresh.run_episode(Episode("e1", {"prompt": "go", "answer": "2"})))
    assert after.status == "success", "the next episode has a server of its own"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def http_url():
    port = free_port()
    server = subprocess.Popen([sys.executable, SERVER, "sdk", "http", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    server.kill()
    server.wait()


@pytest.mark.parametrize("lifetime", ["episode", "shared"])
def test_a_streamable_http_server(http_url, lifetime):
    spec = McpSettings(url=http_url, server=lifetime).spec()
    try:
        env = opened(spec)
        assert env.tool("add")(a=20, b=22) == "42"
        assert tool_content(env.tool("red_square")())[0]["type"] == "image"
        env.close()
    finally:
        spec.env_cls.server.close()


def test_wrong_schemas_a_silent_server_and_garbage_are_clear_errors():
    with pytest.raises(UserError, match=r"could not start: .*inputSchema.type"):
        stdio("raw", "bad_schema").spec()
    with pytest.raises(UserError, match=r"did not start within 2 s \(mcp.startup_timeout_s\)"):
        stdio("raw", "silent", startup_timeout_s=2).spec()
    spec = stdio("raw", "garbage", call_timeout_s=2).spec()
    env = opened(spec)
    with pytest.raises(InfrastructureError, match="tools/call 'ok'"):
        env.tool("ok")()
    env.close()


def test_a_missing_program_is_an_infrastructure_error():
    settings = McpSettings(command=["/nonexistent/server"], startup_timeout_s=5)
    with pytest.raises(UserError, match="could not start.*No such file"):
        settings.spec()


def test_the_config_section_says_what_is_wrong():
    with pytest.raises(ConfigError, match="env: mcp needs an mcp: section"):
        load_config(None, {"env": "mcp"}).env_spec()
    with pytest.raises(ConfigError, match="exactly one of mcp.command"):
        load_config(None, {"env": "mcp", "mcp": {"command": ["x"], "url": "http://127.0.0.1:1/mcp"}})
    with pytest.raises(ConfigError, match="reset_tool is called on a shared server only"):
        load_config(None, {"env": "mcp", "mcp": {"command": ["x"], "reset_tool": "r"}})
    with pytest.raises(ConfigError, match=r"mcp.comand: unknown key \(did you mean 'command'\?\)"):
        load_config(None, {"env": "mcp", "mcp": {"comand": ["x"]}})
    config = load_config(None, {"env": "mcp", "mcp": {"command": ["/usr/bin/python3", SERVER, "sdk", "stdio"],
                                                      "env": {"PYTHONPATH": SITE}, "read_only_paths": [SITE, HERE]}})
    assert "add" in {schema["function"]["name"] for schema in config.env_spec().tools}


def test_trajlab_envs_lists_the_servers_tools():
    from typer.testing import CliRunner

    from trajlab.cli import app

    sets = ["--set", "mcp.command=[/usr/bin/python3, " + SERVER + ", sdk, stdio]", "--set",
            "mcp.env={PYTHONPATH: " + SITE + "}", "--set", f"mcp.read_only_paths=[{SITE}, {HERE}]"]
    result = CliRunner().invoke(app, ["envs", "--json", *sets], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    row = {row["name"]: row for row in json.loads(result.stdout)}["mcp"]
    assert {tool["function"]["name"] for tool in row["tools"]} >= {"add", "red_square", "fail"}
    assert row["limits"]["tool_timeout_s"] == 35.0, "past mcp.call_timeout_s: a silent server is caught as one"
    result = CliRunner().invoke(app, ["envs", "--set", "mcp.command=[/nonexistent/server]"], catch_exceptions=False)
    assert result.exit_code == 1 and result.stdout.startswith("error: MCP server /nonexistent/server could not start")


def test_trajlab_collect_with_env_mcp_set_on_the_command_line(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from trajlab.cli import app
    from trajlab.data.store import read_trajectories

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n{"prompt": "What is 4 + 4?", "answer": "8"}\n')
    sets = ["--set", "mcp.command=[/usr/bin/python3, " + SERVER + ", sdk, stdio]", "--set",
            "mcp.env={PYTHONPATH: " + SITE + "}", "--set", f"mcp.read_only_paths=[{SITE}, {HERE}]"]
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["collect", "--env", "mcp", *sets, "--tasks", str(tasks), "--policy",
                                      str(tiny_model_dir), "--episodes", "2", "--max-new-tokens", "8", "--max-turns",
                                      "1", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    trajectories = list(read_trajectories(out))
    assert sorted(t.task["answer"] for t in trajectories) == ["5", "8"]
    assert all(t.status != "error" and t.tools for t in trajectories), [t.error for t in trajectories]


def test_an_error_episode_is_retried_on_a_restarted_shared_server(shared, tiny_tokenizer, tiny_template):
    restarts = shared.env_cls.server.restarts
    with engine(shared, tiny_tokenizer, tiny_template, [call("die", "{}")]) as dying:
        trajectories = asyncio.run(dying.run([Episode("e", {"prompt": "go"})], concurrency=1, retries=1,
                                             retry_backoff_s=0.0))
    assert [t.status for t in trajectories] == ["error"] and "tools/call 'die'" in trajectories[0].error
    assert shared.env_cls.server.restarts == restarts + 1, "the retry ran on a new server (and killed it too)"


def test_check_env_checks_an_mcp_env(per_episode):
    import trajlab

    report = trajlab.check_env(per_episode, tasks=[{"prompt": "What is 2 + 3?", "answer": "5"}])
    assert report.env == "mcp" and report.tasks == 1 and {"add", "red_square"} <= set(report.tools)


def test_an_image_result_is_token_exact_for_a_vision_model(per_episode, tiny_vision_dir):
    from trajlab.chat.template import ChatTemplate
    from trajlab.inference.policy import load_policy

    def oracle(task, messages):
        if not any(message["role"] == "tool" for message in messages):
            return {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "red_square", "arguments": {}}}]}
        return {"role": "assistant", "content": "red"}

    policy = load_policy("oracle", tokenizer=tiny_vision_dir, oracle=oracle, device="auto", dtype="auto",
                         backend="hf", max_batch_size=4)
    with RolloutEngine(per_episode, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                       parser=get_parser("auto", policy.tokenizer), seed=0, processor=policy.processor) as engine:
        trajectory = asyncio.run(engine.run_episode(Episode("e", {"prompt": "Which color?", "answer": "red"})))
    assert trajectory.status == "success" and len(trajectory.images) == 1
    assert trajectory.image(trajectory.images[0]).getpixel((1, 1)) == (255, 0, 0)
    rendered = ChatTemplate(policy.tokenizer, trajectory.tools, policy.chat_template, policy.processor).render(
        trajectory.messages)
    expanded = policy.processor(text=rendered, images=[trajectory.image(i) for i in trajectory.images],
                                add_special_tokens=False)["input_ids"][0]
    ids = trajectory.tokens.prompt_ids + trajectory.tokens.completion_ids
    assert policy.tokenizer.decode(ids, skip_special_tokens=False) == policy.tokenizer.decode(expanded)
