"""A curriculum against direct RL on a hard setting, at the same budget: which one reaches the hard setting?

    python benchmarks/curriculum.py --model runs/quickstart/sft/final     # after `bash scripts/quickstart.sh`
    python benchmarks/curriculum.py                                       # makes its own SFT model first (~6 min)
    python benchmarks/curriculum.py --sft-steps 2 --demos 16 --steps 2 --tasks-per-step 2 --group-size 2 \\
        --eval-tasks 4                                                     # a smoke run of the whole script

The hard setting is ``arithmetic`` with operands from ``--hard-min`` to ``--hard-max`` (10-20 by default: two-digit
numbers to copy into every call, where the starting model learned on 1-9; the quickstart's SFT model solves none of
them, and its sampled rollouts almost never make even the first call right, so direct RL gets next to no signal).
Both arms start from the same model (the quickstart's SFT checkpoint, or one this script makes the same way:
reference demonstrations on operands 1-9, SFT with the quickstart's recipe) and train for ``--steps`` RL steps of the
same size with the quickstart's RL settings, so on the same number of episodes:

- direct: every step on the hard setting;
- curriculum: a stage per ``--bridges`` value N, operands 1 to N (a mix of known and new sizes: the SFT model solves
  the tasks whose operands are all single digits, about 0.41 of them at N = 12), each until the success rate of its
  last ``--window`` steps reaches ``--threshold``; then the hard setting for the remaining steps.

Then the starting model and both arms are evaluated greedily on the same ``--eval-tasks`` held-out tasks of the hard
setting. Reported per arm: held-out success and progress on the hard setting, the steps each stage got, the share of
groups whose rewards were all equal (no gradient), and wall time. ``--work-dir`` keeps the SFT model and each arm's
run, which a second call resumes: give another one for other settings.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from trajlab import api
from trajlab.cli.output import Verbosity, configure
from trajlab.env.registry import EnvSpec, load_env
from trajlab.models import init_tiny_model

QUICKSTART_ROLLOUT = {"max_turns": 4, "max_new_tokens": 40, "max_episode_tokens": 512, "concurrency": 64}
QUICKSTART_RL = {"estimator": "grpo", "credit": "turn", "rewards": {"env": 1.0, "progress": 1.0},
                 "learning_rate": 3e-4, "warmup_steps": 2}


def start_model(args: argparse.Namespace) -> Path:
    """``--model``, else an SFT model made as the quickstart makes it (resumed from ``--work-dir`` if there)."""
    if args.model is not None:
        if not (args.model / "config.json").exists():
            raise SystemExit(f"{args.model} is not a model directory (run `bash scripts/quickstart.sh`, or leave out "
                             "--model to make one here).")
        return args.model
    work = args.work_dir / "start"
    final = work / "sft" / "final"
    if (final / "config.json").exists():
        return final
    base = init_tiny_model(work / "model", seed=0, overwrite=True)
    demos = api.collect("arithmetic", "oracle", out=work / "demos.jsonl", tokenizer=str(base), episodes=args.demos,
                        rollout=QUICKSTART_ROLLOUT)
    return api.sft(base, demos, work / "sft", device="cpu", max_steps=args.sft_steps, batch_size=8,
                   learning_rate=3e-3, lr_scheduler="constant_with_warmup", warmup_steps=min(10, args.sft_steps),
                   save_steps=max(1, args.sft_steps))


def evaluate(model: Path, hard: EnvSpec, out: Path, tasks: int) -> dict[str, float]:
    report = api.evaluate(hard, str(model), out=out, rollout=QUICKSTART_ROLLOUT, rewards={"env": 1.0, "progress": 1.0},
                          device="cpu", num_tasks=tasks)
    return {"success": report.success_rate, "progress": report.reward_components.get("progress", 0.0)}


def train(model: Path, out: Path, args: argparse.Namespace, curriculum: dict[str, Any] | None) -> dict[str, Any]:
    """One arm's RL run (resumed if ``out`` holds one); its steps per stage and share of flat groups."""
    began = time.perf_counter()
    hard = {"min_operand": args.hard_min, "max_operand": args.hard_max}
    api.rl(model, load_env("arithmetic").with_options(**hard), out, device="cpu", seed=args.seed, resume=True,
           rollout=QUICKSTART_ROLLOUT, curriculum=curriculum, steps=args.steps, tasks_per_step=args.tasks_per_step,
           group_size=args.group_size, save_steps=max(1, args.steps // 4), **QUICKSTART_RL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stages = [int(r.get("curriculum/stage", 0)) for r in records]
    count = len(curriculum["stages"]) if curriculum else 1
    return {"final": out / "final", "wall_s": time.perf_counter() - began,
            "steps per stage": "/".join(str(stages.count(i)) for i in range(count)),
            "flat groups": sum(r["rollout/zero_variance_groups"] for r in records) / len(records),
            "train success, last 5 steps": sum(r["rollout/success_rate"] for r in records[-5:]) / len(records[-5:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="starting model (default: make an SFT model)")
    parser.add_argument("--demos", type=int, default=2000, help="reference demonstrations for the SFT model")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=60, help="RL steps of each arm")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--hard-min", type=int, default=10)
    parser.add_argument("--hard-max", type=int, default=20)
    parser.add_argument("--bridges", type=int, nargs="+", default=[12, 16],
                        help="the largest operand of each stage before the hard one")
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-curriculum")
    args = parser.parse_args()
    configure(Verbosity.NORMAL)  # the console trajlab's commands have: one line per record, library noise off

    model = start_model(args)
    hard = load_env("arithmetic").with_options(min_operand=args.hard_min, max_operand=args.hard_max)
    promote = {"metric": "train_success", "window": args.window, "threshold": args.threshold}
    curriculum = {"stages": [
        *({"name": f"1-{top}", "difficulty": {"max_operand": top}, "promote": promote} for top in args.bridges),
        {"name": "hard", "difficulty": {"min_operand": args.hard_min, "max_operand": args.hard_max}},
    ]}
    rows: dict[str, dict[str, Any]] = {"start": {"final": model}}
    for name, plan in (("direct", None), ("curriculum", curriculum)):
        rows[name] = train(model, args.work_dir / name, args, plan)
    for name, row in rows.items():
        row |= evaluate(row["final"], hard, args.work_dir / f"eval-{name}", args.eval_tasks)

    print(f"\narithmetic, operands {args.hard_min}-{args.hard_max}: {args.eval_tasks} held-out tasks, greedy; "
          f"{args.steps} RL steps x {args.tasks_per_step} tasks x {args.group_size} rollouts per arm; model {model}")
    columns = ["success", "progress", "steps per stage", "flat groups", "train success, last 5 steps", "wall_s"]
    print("| arm | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in rows.items():
        cells = [f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    promoted = (args.work_dir / "curriculum" / "curriculum.jsonl").read_text().strip()
    print("curriculum promotions:", *(promoted.splitlines() or ["none"]), sep="\n  ")


if __name__ == "__main__":
    main()
