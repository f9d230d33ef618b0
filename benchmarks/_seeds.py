"""What the seed benchmarks share: one `trajlab run` per seed in a subprocess, and the statistics of their results.

Imported by ``quickstart_seeds.py`` and ``env_learning.py`` (run as scripts, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(config: Path, seed: int, run_dir: Path, sets: Sequence[str] = ()) -> tuple[list[dict], float]:
    """``trajlab run CONFIG`` with ``seed`` as both the training seed and the tiny model's weight seed (and any
    further ``--set`` items); returns its ``results.json`` and the wall time. A finished run is resumed, not redone.

    The repository root is put on ``PYTHONPATH``, so a config naming an env by import path from this repository
    (``examples.inventory.env:SPEC``) runs from any directory."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "trajlab.cli", "run", str(config), "--run-dir", str(run_dir),
               "--set", f"seed={seed}", "--set", f"model.init_seed={seed}"]
    for item in sets:
        command += ["--set", item]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with subprocess.Popen(command, env={**os.environ, "PYTHONPATH": path}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as child:
        lines = []
        for line in child.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, command)
    record_stage_seconds(lines, run_dir / "stage_seconds.json")
    return json.loads((run_dir / "results.json").read_text()), time.perf_counter() - started


def record_stage_seconds(lines: Sequence[str], path: Path) -> dict[str, float]:
    """The seconds each stage took, from the run's ``<stage> took <N>s`` log lines, numbered in order (``eval-0``,
    ``sft-0``, ...), kept in ``path`` across resumed runs: a stage timed once keeps its first time (a resumed run
    finds it done in no time)."""
    recorded = json.loads(path.read_text()) if path.exists() else {}
    counts: dict[str, int] = {}
    for line in lines:
        found = re.search(r"\b(\w+) took (\d+)s$", line.rstrip())
        if found:
            stage = found.group(1)
            recorded.setdefault(f"{stage}-{counts.get(stage, 0)}", float(found.group(2)))
            counts[stage] = counts.get(stage, 0) + 1
    path.write_text(json.dumps(recorded, indent=2))
    return recorded


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {std:.3f}"


def task_changes(before: dict, after: dict) -> tuple[int, int]:
    """Held-out tasks fixed and broken between two evaluations of the same tasks (greedy: one episode each)."""
    solved = {t["task_id"]: t["successes"] == t["n"] for t in before["tasks"]}
    now = {t["task_id"]: t["successes"] == t["n"] for t in after["tasks"]}
    common = solved.keys() & now.keys()
    return sum(now[k] and not solved[k] for k in common), sum(solved[k] and not now[k] for k in common)


def sign_test(fixed: int, broken: int) -> float:
    """Two-sided exact sign (McNemar) test: how likely so lopsided a split is if RL only moved errors around."""
    n = fixed + broken
    if n == 0:
        return 1.0
    probabilities = [math.comb(n, k) / 2**n for k in range(n + 1)]
    return min(1.0, sum(p for p in probabilities if p <= probabilities[fixed] * (1 + 1e-9)))
