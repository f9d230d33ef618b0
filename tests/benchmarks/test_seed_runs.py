"""What the seed benchmarks read from a run's log: each stage's wall time, kept across a resumed run (issue 45's
wall-time condition, RL at most twice SFT, is read from it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "benchmark_seeds", Path(__file__).resolve().parents[2] / "benchmarks" / "_seeds.py")
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
