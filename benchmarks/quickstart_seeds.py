"""Run the quickstart pipeline over several seeds and report the mean and spread of each stage's held-out metrics.

Each seed sets both the tiny model's initial weights and the training seed (task order, sampling), and runs the
docs' own command, ``trajlab run``, in a subprocess. All seeds are scored on the same held-out test tasks.

    python benchmarks/quickstart_seeds.py                 # seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _seeds import run_seed, sign_test, spread, task_changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/quickstart.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
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
