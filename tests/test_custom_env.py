"""The docs' "Your own env, end to end" (docs/own-env.md) on its example, an env written outside the package
(``examples/inventory``): it passes ``trajlab.check_env``, and ``trajlab run`` on its config completes (with tiny
budgets here; whether it learns is ``benchmarks/env_learning.py``'s question)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import trajlab
from trajlab.cli import app

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "inventory" / "config.yaml"
TINY = ["collect.episodes=16", "sft.max_steps=2", "sft.batch_size=4", "sft.warmup_steps=0", "rl.steps=1",
        "rl.tasks_per_step=2", "rl.group_size=2", "eval.num_tasks=4", "rollout.concurrency=16"]


@pytest.fixture(autouse=True)
def repository_on_path(monkeypatch):
    """As `PYTHONPATH=.` from the repository root, the docs' command."""
    monkeypatch.syspath_prepend(str(ROOT))


def test_the_example_env_passes_check_env():
    report = trajlab.check_env("examples.inventory.env:SPEC", tasks_per_split=4)
    assert report.tools == ["lookup", "order", "report"] and report.oracle_solved == report.tasks == 8


def test_trajlab_run_completes_on_the_example_config(tmp_path):
    sets = [item for setting in TINY for item in ("--set", setting)]
    result = CliRunner().invoke(app, ["run", str(CONFIG), "--run-dir", str(tmp_path / "run"), *sets],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    reports = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [r["label"] for r in reports] == ["untrained", "sft", "rl"]
    assert all(r["episodes"] == 4 for r in reports)
    demos = [json.loads(line) for line in (tmp_path / "run" / "demos.jsonl").read_text().splitlines()]
    assert len(demos) == 16 and all(d["env"] == "inventory" and d["status"] == "success" for d in demos)
    assert (tmp_path / "run" / "report.html").exists()


def test_the_example_pays_a_step_once_so_rl_cannot_farm_it():
    """From noisy demonstrations RL learned to call lookup four times, each paying 1/3 (BENCHMARKS.md, issue 45)."""
    from examples.inventory.env import Inventory

    env = Inventory()
    env.reset(task_id="t", item="tea", stock=3, target=9)
    for _ in range(3):
        env.lookup("tea")
    env.order("tea", 6)
    env.report(9)
    assert env.turn_rewards == [1 / 3, 0.0, 0.0, 1 / 3, 1 / 3] and env.success


def _reference_after_a_mistake(env, task, oracle, mistake):
    """Play ``mistake`` (a call that fails), then up to three of the reference's calls, as a noisy demonstration goes
    on after its error: the conversation and the last call."""
    env.reset(**task)
    messages = [{"role": "user", "content": "..."}]
    for call in (mistake, None, None, None):
        call = call or oracle(task, messages)["tool_calls"][0]["function"]
        try:
            result = getattr(env, call["name"])(**call["arguments"])
        except ValueError as error:
            result = str(error)
        messages += [{"role": "assistant", "tool_calls": [{"function": call}]}, {"role": "tool", "content": result}]
    return messages, call


def test_the_tickets_env_passes_check_env_and_its_reference_goes_on_after_a_mistake():
    """``examples/tickets``, the env written to see the default RL recipe on an env it was not chosen on: its
    reference policy still solves a task after a call that failed, as the noisy reference's demonstrations need."""
    from examples.tickets.env import SPEC, Tickets, oracle

    report = trajlab.check_env("examples.tickets.env:SPEC", tasks_per_split=4)
    assert report.tools == ["buy", "confirm", "find_route"] and report.oracle_solved == report.tasks == 8
    task = next(SPEC.tasks("test", 0))
    env = Tickets()
    wrong = {"origin": task["origin"][::-1], "destination": task["destination"]}
    messages, _ = _reference_after_a_mistake(env, task, oracle, {"name": "find_route", "arguments": wrong})
    assert env.done and env.success and env.reward == 1.0
    assert messages[2]["content"].startswith("no route is planned") and len(messages) == 9


def test_the_rooms_env_passes_check_env_and_fails_a_task_with_one_copied_field_wrong():
    """``examples/rooms``, the second env written after the default RL recipe was chosen: its reference solves a task
    after a failed call, and a booking for another title or an invitation with any one field wrong fails the task."""
    from examples.rooms.env import SPEC, Rooms, oracle

    report = trajlab.check_env("examples.rooms.env:SPEC", tasks_per_split=4)
    assert report.tools == ["book", "find_room", "invite"] and report.oracle_solved == report.tasks == 8
    task = next(SPEC.tasks("test", 0))
    env = Rooms()
    wrong = {"day": task["day"], "people": task["people"] + 1}
    messages, call = _reference_after_a_mistake(env, task, oracle, {"name": "find_room", "arguments": wrong})
    assert env.done and env.success and env.reward == 1.0 and messages[2]["content"].startswith("no meeting")
    invitation = call["arguments"]
    for field, value in invitation.items():
        env.invite(**invitation | {field: value + 1 if isinstance(value, int) else value + "0"})
        assert not env.success and env.reward == 0.0, field
    env.booked[0] = (*env.booked[0][:3], "another meeting")
    env.invite(**invitation)
    assert not env.success
