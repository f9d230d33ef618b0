"""Run the quickstart pipeline over several seeds and report the mean and spread of each stage's held-out metrics.

Each seed sets both the tiny model's initial weights and the training seed (task order, sampling), and runs the
README's own command, ``trajlab run``, in a subprocess. All seeds are scored on the same held-out test tasks.

    python benchmarks/quickstart_seeds.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_seed(config: Path, seed: int, run_dir: Path) -> tuple[list[dict], float]:
    started = time.perf_counter()
    command = [sys.executable, "-m", "trajlab.cli", "run", str(config), "--run-dir", str(run_dir),
               "--set", f"seed={seed}", "--set", f"model.init_seed={seed}"]
    subprocess.run(command, check=True)
    return json.loads((run_dir / "results.json").read_text()), time.perf_counter() - started


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/quickstart.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/quickstart-seeds"))
    args = parser.parse_args()

    per_seed = {}
    for seed in args.seeds:
        reports, seconds = run_seed(args.config, seed, args.runs_dir / f"seed{seed}")
        per_seed[seed] = {"seconds": seconds, "stages": {r["label"]: r for r in reports}}

    labels = list(next(iter(per_seed.values()))["stages"])
    metrics = [("success_rate", lambda r: r["success_rate"]),
               ("progress", lambda r: r["reward_components"].get("progress", float("nan")))]
    print(f"\n{'stage':<12}" + "".join(f"{name:>22}" for name, _ in metrics) + "   per seed (success)")
    for label in labels:
        row = [per_seed[s]["stages"][label] for s in args.seeds]
        cells = "".join(f"{spread([get(r) for r in row]):>22}" for _, get in metrics)
        print(f"{label:<12}{cells}   {[round(r['success_rate'], 3) for r in row]}")
    if {"sft", "rl"} <= set(labels):
        gains = [per_seed[s]["stages"]["rl"]["success_rate"] - per_seed[s]["stages"]["sft"]["success_rate"]
                 for s in args.seeds]
        print(f"\nRL gain over SFT (success): {spread(gains)}  per seed {[round(g, 3) for g in gains]}")
        for seed in args.seeds:
            fixed, broken = task_changes(per_seed[seed]["stages"]["sft"], per_seed[seed]["stages"]["rl"])
            print(f"seed {seed}: RL solved {fixed} held-out tasks SFT failed and failed {broken} SFT solved; "
                  f"exact two-sided sign test p = {sign_test(fixed, broken):.2g}")
    print(f"wall time per run: {spread([per_seed[s]['seconds'] for s in args.seeds])} s")
    summary = {str(s): {"seconds": v["seconds"],
                        "success_rate": {k: r["success_rate"] for k, r in v["stages"].items()},
                        "progress": {k: r["reward_components"].get("progress") for k, r in v["stages"].items()}}
               for s, v in per_seed.items()}
    (args.runs_dir / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
