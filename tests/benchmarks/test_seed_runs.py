"""What the seed benchmarks read from a run's log: each stage's wall time, kept across a resumed run (issue 45's
wall-time condition, RL at most twice SFT, is read from it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_SPEC = importlib.util.spec_from_file_location("benchmark_seeds", _BENCHMARKS / "_seeds.py")
_SEEDS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_SEEDS)
record_stage_seconds = _SEEDS.record_stage_seconds


def test_each_stage_is_timed_in_order_and_a_resumed_run_keeps_the_first_time(tmp_path: Path) -> None:
    path = tmp_path / "stage_seconds.json"
    first = ["01:49:34 eval took 12s\n", "01:49:47 collect took 13s\n", "noise: it took 5s to say\n",
             "02:00:01 sft took 286s\n", "02:00:30 eval took 36s\n"]
    assert record_stage_seconds(first, path) == {"eval-0": 12.0, "collect-0": 13.0, "sft-0": 286.0, "eval-1": 36.0}
    resumed = ["eval took 0s", "collect took 0s", "sft took 0s", "eval took 0s", "rl took 168s", "eval took 35s"]
    assert record_stage_seconds(resumed, path) == {"eval-0": 12.0, "collect-0": 13.0, "sft-0": 286.0,
                                                   "eval-1": 36.0, "rl-0": 168.0, "eval-2": 35.0}
    assert json.loads(path.read_text())["rl-0"] == 168.0


def test_the_table_reports_an_unknown_wall_ratio_when_the_reused_sft_was_not_timed(capsys, monkeypatch) -> None:
    """A run reusing an SFT model copied while its own run was still going has no SFT time (0 s): the ratio is
    unknown, not a crash that loses the runs' table (it crashed so once, after 40 minutes of RL)."""
    monkeypatch.syspath_prepend(str(_BENCHMARKS))
    spec = importlib.util.spec_from_file_location("benchmark_env_learning", _BENCHMARKS / "env_learning.py")
    env_learning = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env_learning)

    def evaluation(solved: list[bool]) -> dict:
        return {"success_rate": sum(solved) / len(solved), "mean_reward": 0.0,
                "tasks": [{"task_id": f"t{i}", "n": 1, "successes": int(ok)} for i, ok in enumerate(solved)]}

    run = {"seconds": 60.0, "stage_seconds": {"sft-0": 0.0, "rl-0": 50.0},
           "stages": {"sft": evaluation([True, False, False]), "rl": evaluation([True, True, False])}}
    env_learning.table("driving-noisy-failures", {0: run})
    printed = capsys.readouterr().out
    assert "0.50 of SFT's gap closed" in printed and "solved 1 held-out tasks SFT failed, failed 0" in printed
    assert "RL's wall time nanx SFT's" in printed
