"""Experiment trackers: TensorBoard event files written by RL, SFT and eval, read back; every logged name documented."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import trajlab
from trajlab.errors import MissingDependency, UserError
from trajlab.tracking import Trackers

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

METRICS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files of ``log_dir`` (not its hparams sub-runs), by tag and step."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def documented_names() -> list[re.Pattern[str]]:
    """The names of docs/metrics.md's table as patterns: ``<...>`` is any one path part, ``<a, b>`` one of those."""
    section = METRICS.read_text().split("# Metrics and experiment trackers\n", 1)[1].split("\n## ", 1)[0]
    patterns = []
    for row in re.findall(r"^\| (.+?) \| [a-z, ]+ \|", section, flags=re.M):
        for name in re.findall(r"`([^`]+)`", row):
            def part(match: re.Match[str]) -> str:
                choices = [c.strip() for c in match.group(1).split(",")]
                return "(" + "|".join(map(re.escape, choices)) + ")" if len(choices) > 1 else "[^/]+"

            pieces = re.split(r"(<[^>]+>)", name)
            patterns.append(re.compile("".join(part(re.match(r"<([^>]+)>", p)) if p.startswith("<") else
                                               re.escape(p) for p in pieces) + "$"))
    return patterns


def undocumented(names: set[str]) -> list[str]:
    patterns = documented_names()
    return sorted(name for name in names if not any(p.match(name) for p in patterns))


def test_rl_sends_every_step_to_tensorboard_under_documented_names(terse_model_dir, tmp_path):
    from ..rollout.length_env import SPEC as LENGTH

    run = tmp_path / "run"
    trajlab.rl(terse_model_dir, LENGTH, run / "rl", report_to=["tensorboard"], device="cpu", steps=2, tasks_per_step=2,
           group_size=2, rewards={"env": 1.0}, rollout={"max_turns": 1, "max_new_tokens": 16, "concurrency": 4})
    records = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    logged = scalars(run / "tensorboard" / "rl")
    assert set(logged) == {name for record in records for name in record if name != "step"}
    for record in records:
        for name, value in record.items():
            if name != "step":
                assert logged[name][record["step"]] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    assert {"reward/mean", "rollout/success_rate", "loss/kl", "optim/grad_norm", "perf/tokens_per_s"} <= set(logged)
    assert undocumented(set(logged)) == []


def test_sft_and_eval_send_theirs(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path):
    from .test_sft import demonstrations

    run = tmp_path / "run"
    trajlab.sft(tiny_model_dir, demonstrations(tiny_tokenizer, tiny_template), run / "sft", report_to=["tensorboard"],
            device="cpu", max_steps=3, batch_size=4, logging_steps=1, save_steps=10, warmup_steps=0)
    records = [json.loads(line) for line in (run / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss/sft"] for r in records if "loss/sft" in r}
    assert sorted(losses) == [1, 2, 3]
    logged = scalars(run / "tensorboard" / "sft")
    assert logged["loss/sft"] == pytest.approx(losses) and "optim/lr" in logged
    assert undocumented(set(logged)) == []

    report = trajlab.evaluate("arithmetic", "oracle", out=run / "eval-0-oracle", tokenizer=str(tiny_model_dir),
                          report_to=["tensorboard"], num_tasks=3, rewards={"env": 1.0, "progress": 0.5})
    logged = scalars(run / "tensorboard" / "eval-0-oracle")
    assert logged["eval/success_rate"] == {0: report.success_rate} and report.success_rate == 1.0
    assert "eval/pass@1" in logged and "eval/reward/progress" in logged
    assert undocumented(set(logged)) == []


def test_unknown_or_missing_trackers_say_what_to_do(tmp_path):
    with pytest.raises(UserError, match=r"unknown tracker\(s\) \['neptune'\]; choose from tensorboard, wandb"):
        Trackers(["neptune"], tmp_path, "rl")
    with pytest.raises(UserError, match="report_to needs out="):
        trajlab.evaluate("arithmetic", "oracle", report_to=["tensorboard"], num_tasks=1)
    missing = [name for name in ("wandb", "trackio", "mlflow") if _absent(name)]
    for name in missing:  # the test environment installs tensorboard only
        with pytest.raises(MissingDependency, match=rf"report_to: {name} needs .* pip install 'trajlab\[{name}\]'"):
            Trackers([name], tmp_path, "rl")


def test_a_config_names_only_known_trackers(tmp_path):
    from trajlab.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text("env: arithmetic\nreport_to: [tensorboard, tensorbored]\n")
    with pytest.raises(ConfigError, match="report_to"):
        load_config(path)


def _absent(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
