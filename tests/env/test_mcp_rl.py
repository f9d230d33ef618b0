"""A short RL run on the tiny model through an MCP env: the SDK test server, shared, over stdio in the sandbox."""

import json

import trajlab
from tests.env.test_mcp import stdio
from trajlab.config import RLSettings, RolloutSettings
from trajlab.data.store import read_trajectories
from trajlab.models.loading import load_tokenizer

TASKS = [{"prompt": f"What is {a} + {b}? Use the add tool, then answer with the number.", "answer": str(a + b)}
         for a, b in [(2, 3), (4, 5), (6, 7)]]


def test_rl_steps_through_an_mcp_env(tiny_model_dir, tmp_path):
    spec = stdio("sdk", "stdio", server="shared", reset_tool="restart_count").spec(tasks=TASKS)
    try:
        settings = RLSettings(steps=1, tasks_per_step=2, group_size=2, minibatch_size=4, kl_coef=0.01)
        rollout = RolloutSettings(max_turns=2, max_new_tokens=8, concurrency=4)
        trajlab.rl(tiny_model_dir, spec, tmp_path, tokenizer=load_tokenizer(tiny_model_dir), rollout=rollout,
                   **settings.model_dump())
    finally:
        spec.env_cls.server.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1] and "loss/kl" in records[0]
    rollouts = list(read_trajectories(tmp_path / "rollouts.jsonl"))
    assert len(rollouts) == 4 and all(t.status != "error" for t in rollouts), [t.error for t in rollouts]
    assert {t.task["answer"] for t in rollouts} <= {"5", "9", "13"}
    assert {tool["function"]["name"] for tool in rollouts[0].tools} >= {"add", "bump"}, "the server's tools shown"
