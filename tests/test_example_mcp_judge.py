"""The MCP + judge + dataset example (``examples/mcp_judge``, docs/mcp.md "A whole example"): ``bash
examples/mcp_judge/run.sh`` as a real subprocess with tiny budgets. Its stand-in judge is a real HTTP server that
grades by a rule (a FAKE standing in for a judge model, which cannot run here); the MCP server is the example's own,
over stdio in the sandbox. Whether the model learns is not asked here, only that every piece runs through RL."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from examples.mcp_judge.judge_server import grade
from tests.env.reachable import reachable
from trajlab.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = ROOT / "examples" / "mcp_judge" / "run.sh"
TINY = ["collect.episodes=16", "sft.max_steps=30", "rl.steps=1", "rl.tasks_per_step=2", "rl.group_size=2",
        "eval.num_tasks=2"]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow(72)
def test_run_sh_trains_the_mcp_tools_with_the_judge_reward(tmp_path):
    run = tmp_path / "run"
    sets = [item for setting in TINY for item in ("--set", setting)]
    # run.sh binds the checkout's own paths; where the sandbox's uid cannot read them (a clone under a 0700
    # directory), a mirror it can read is given instead, after run.sh's own settings (the last --set wins)
    here, site = reachable(str(RUN_SH.parent)), reachable(sysconfig.get_paths()["purelib"])
    sets += ["--set", f"mcp.command=[/usr/bin/python3, {here}/server.py]", "--set", f"mcp.env={{PYTHONPATH: {site}}}",
             "--set", f"mcp.read_only_paths=[{here}, {site}]"]
    env = os.environ | {"RUN_DIR": str(run), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(RUN_SH), *sets], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"report: {run}/report.html" in result.stdout and (run / "report.html").exists()
    assert [r["label"] for r in json.loads((run / "results.json").read_text())] == ["untrained", "sft", "rl"]
    step = lines(run / "rl" / "metrics.jsonl")[0]
    assert {"reward/judge", "reward/env", "reward/brevity"} <= set(step) and step["judge/calls"] > 0, step
    judged = lines(run / "judge-requests.jsonl")
    assert len(judged) >= step["judge/calls"], "the stand-in judge really answered the RL step's requests"
    rollouts = lines(run / "rl" / "rollouts.jsonl")
    assert len(rollouts) == 4 and not [t["error"] for t in rollouts if t["status"] == "error"]
    tool_messages = [m for t in rollouts for m in t["messages"] if m["role"] == "tool"]
    assert tool_messages, "after SFT on the demonstrations the policy calls the MCP server's tools"
    assert {t["function"]["name"] for t in rollouts[0]["tools"]} == {"convert", "list_units"}
    assert all(t["task"]["prompt"].startswith("Convert ") and "answer" in t["task"] for t in rollouts), \
        "the Parquet's question/expected columns reached the env as prompt/answer"
    demos = lines(run / "demos.jsonl")
    assert len(demos) == 16 and all(d["status"] == "success" for d in demos), "the scripted demonstrator solves all"


def test_the_stand_in_judge_grades_by_its_rule():
    def prompt(final: str, tool: str) -> str:
        return ('# Rubric\nr\n\n# Task (as the environment received it)\n{"prompt": "Convert 3 ft to m.", '
                f'"answer": "0.91"}}\n\n# Conversation\n[user]\nConvert 3 ft to m.\n\n[assistant]\n\n-> calls '
                f'convert({{"value": 3}})\n\n[tool convert]\n{tool}\n\n[assistant]\n{final}')

    assert grade(prompt("0.91", "0.91"))[0] == 1.0
    assert grade(prompt("It is 0.91 m", "0.91"))[0] == 1.0
    assert grade(prompt("7", "0.91"))[0] == 0.5
    assert grade(prompt("7", "Error: unknown unit"))[0] == 0.0


def test_mcp_oracle_must_name_a_function(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    base = {"env": "mcp", "mcp": {"command": ["/usr/bin/python3", "server.py"]}}
    config = load_config(None, base | {"mcp": base["mcp"] | {"oracle": "examples.mcp_judge.policy:oracle"}})
    assert config.mcp.oracle == "examples.mcp_judge.policy:oracle"
    for path, message in [("examples.mcp_judge.policy", "an import path 'my_pkg.policy:oracle'"),
                          ("examples.mcp_judge.policy:orcale", "has no attribute 'orcale'"),
                          ("examples.mcp_judge.nope:oracle", "No module named 'examples.mcp_judge.nope'")]:
        with pytest.raises(ConfigError, match=f"mcp.oracle.*{message}"):
            load_config(None, base | {"mcp": base["mcp"] | {"oracle": path}})
