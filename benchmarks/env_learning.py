"""Does the default recipe learn each env? Held-out success untrained, after SFT and after RL, over seeds, per config.

    python benchmarks/env_learning.py               # the six configs below, seeds 0 1 2: about 5 h on 2 cores
    python benchmarks/env_learning.py --configs examples/inventory/config.yaml --seeds 0 1 2   # an env of your own
    python benchmarks/env_learning.py --seeds 0 --set collect.episodes=16 --set sft.max_steps=2 --set rl.steps=1 \\
        --set rl.tasks_per_step=2 --set rl.group_size=2 --set eval.num_tasks=4   # a smoke run of the whole script

Each (config, seed) runs the docs' own command, ``trajlab run CONFIG``, in a subprocess, with the seed as both the
training seed and the tiny model's weight seed (as ``quickstart_seeds.py`` does), in ``RUNS_DIR/<config>/seed<S>``; a
finished run is resumed, not redone, so give another ``--runs-dir`` for other ``--set`` items. All seeds of a config
are scored on the same held-out tasks. Per config it prints each evaluation's success rate and mean reward (mean ±
std over seeds, and per seed), then per seed RL's change over SFT: the held-out tasks RL solved that SFT failed and
the reverse, with the exact two-sided sign test. ``RUNS_DIR/summary.json`` keeps the numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _seeds import run_seed, sign_test, spread, task_changes

CONFIGS = [Path("configs/quickstart.yaml"), Path("configs/guess.yaml"), Path("configs/guess-impatient.yaml"),
           Path("configs/driving.yaml"), Path("configs/driving-noisy.yaml"), Path("configs/driving-overconfident.yaml")]


def table(name: str, per_seed: dict[int, dict]) -> None:
    """One config's table: a row per evaluation, then RL against SFT per seed."""
    seeds = list(per_seed)
    labels = list(per_seed[seeds[0]]["stages"])
    print(f"\n{name}\n{'stage':<12}{'success':>18}{'mean reward':>18}   per seed (success)")
    for label in labels:
        row = [per_seed[s]["stages"][label] for s in seeds]
        rates = " / ".join(f"{r['success_rate']:.3f}" for r in row)
        print(f"{label:<12}{spread([r['success_rate'] for r in row]):>18}{spread([r['mean_reward'] for r in row]):>18}"
              f"   {rates}")
    if {"sft", "rl"} <= set(labels):
        for seed in seeds:
            sft, rl = per_seed[seed]["stages"]["sft"], per_seed[seed]["stages"]["rl"]
            fixed, broken = task_changes(sft, rl)
            print(f"seed {seed}: RL {rl['success_rate'] - sft['success_rate']:+.3f} over SFT; solved {fixed} held-out "
                  f"tasks SFT failed, failed {broken} SFT solved; sign test p = {sign_test(fixed, broken):.2g}")
    print(f"wall time per run: {spread([per_seed[s]['seconds'] for s in seeds])} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=Path, nargs="+", default=CONFIGS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/env-learning"))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every `trajlab run` (e.g. smaller budgets); repeatable")
    args = parser.parse_args()

    results = {}
    for config in args.configs:
        name = config.parent.name if config.stem == "config" else config.stem  # examples/inventory/config.yaml
        per_seed = {}
        for seed in args.seeds:
            reports, seconds = run_seed(config, seed, args.runs_dir / name / f"seed{seed}", args.sets)
            per_seed[seed] = {"seconds": seconds, "stages": {r["label"]: r for r in reports}}
        results[name] = per_seed

    for name, per_seed in results.items():
        table(name, per_seed)
    summary = {name: {str(seed): {"seconds": run["seconds"],
                                  "success_rate": {k: r["success_rate"] for k, r in run["stages"].items()},
                                  "mean_reward": {k: r["mean_reward"] for k, r in run["stages"].items()}}
                      for seed, run in per_seed.items()}
               for name, per_seed in results.items()}
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    (args.runs_dir / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
