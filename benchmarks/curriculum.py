"""A curriculum against direct RL on a long horizon, at the same budget: which one reaches the hard setting?

    python benchmarks/curriculum.py                  # makes its own start model first (~6 min), then both arms
    python benchmarks/curriculum.py --sft-steps 2 --demos 4 --steps 2 --tasks-per-step 2 --group-size 2 \\
        --eval-tasks 4                                # a smoke run of the whole script

The hard setting is ``arithmetic`` with ``--hard`` operations (4 by default: ``Compute (((a op b) op c) op d) op e.``,
four tool calls, each after the first copying the previous call's result). The start model has seen every horizon
but is unreliable at the longer ones: ``--demos`` reference demonstrations at each of 1 to ``--hard`` operations,
SFT for ``--sft-steps`` steps at a constant rate (stopped early on purpose: with the quickstart's full recipe it
would solve them all, and RL would have nothing to learn). It copies the numbers of the question, but rarely a tool
result into the next call, so its samples solve 1-operation tasks, now and then 2-operation ones and almost never
the hard ones. Both arms start from it and train for ``--steps`` RL steps of the same size (``--tasks-per-step`` x
``--group-size`` rollouts; the quickstart's rewards and credit, rate ``--learning-rate``, constant), so on the same
number of episodes:

- direct: every step on the hard setting;
- curriculum: a stage per operation count from ``--first`` to ``--hard``, each with ``max_turns`` operations + 2,
  promoted when the success rate of its last ``--window`` steps reaches ``--threshold``.

Then the start model and both arms are evaluated greedily on the same ``--eval-tasks`` held-out tasks of every
operation count from 1 to ``--hard``. Reported per arm: held-out success (and progress) per operation count, the
steps each stage got, the share of groups whose rewards were all equal (no gradient), and wall time.
``--work-dir`` keeps the start model and each arm's run, which a second call resumes: give another one for other
settings.
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

REWARDS = {"env": 1.0, "progress": 1.0}


def limits(operations: int) -> dict[str, int]:
    """The quickstart's episode limits, with a turn per call, one for the answer and one spare."""
    return {"max_turns": operations + 2, "max_new_tokens": 40, "max_episode_tokens": 512}


def rollout(operations: int) -> dict[str, int]:
    """``limits`` and the quickstart's episodes in flight."""
    return limits(operations) | {"concurrency": 64}


def arithmetic(operations: int) -> EnvSpec:
    return load_env("arithmetic").with_options(operations=operations)


def start_model(args: argparse.Namespace) -> Path:
    """Reference demonstrations at every horizon, SFT stopped early (resumed from ``--work-dir`` if there)."""
    work = args.work_dir / "start"
    final = work / "sft" / "final"
    if (final / "config.json").exists():
        return final
    base = init_tiny_model(work / "model", seed=args.seed, overwrite=True)
    demos = []
    for operations in range(1, args.hard + 1):
        demos += api.collect(arithmetic(operations), "oracle", out=work / f"demos-{operations}.jsonl",
                             tokenizer=str(base), episodes=args.demos, rollout=rollout(operations), seed=args.seed)
    return api.sft(base, demos, work / "sft", device="cpu", max_steps=args.sft_steps, batch_size=8,
                   learning_rate=3e-3, lr_scheduler="constant_with_warmup", warmup_steps=min(10, args.sft_steps),
                   save_steps=max(1, args.sft_steps), seed=args.seed)


def train(model: Path, out: Path, args: argparse.Namespace, curriculum: dict[str, Any] | None) -> dict[str, Any]:
    """One arm's RL run (resumed if ``out`` holds one); its steps per stage and share of flat groups."""
    began = time.perf_counter()
    api.rl(model, arithmetic(args.hard), out, device="cpu", seed=args.seed, resume=True, rollout=rollout(args.hard),
           curriculum=curriculum, steps=args.steps, tasks_per_step=args.tasks_per_step, group_size=args.group_size,
           save_steps=max(1, args.steps // 4), estimator="grpo", credit="turn", rewards=REWARDS,
           learning_rate=args.learning_rate, warmup_steps=2)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stages = [int(r.get("curriculum/stage", 0)) for r in records]
    count = len(curriculum["stages"]) if curriculum else 1
    return {"final": out / "final", "wall_s": time.perf_counter() - began,
            "steps per stage": "/".join(str(stages.count(i)) for i in range(count)),
            "flat groups": sum(r["rollout/zero_variance_groups"] for r in records) / len(records)}


def evaluate(model: Path, operations: int, out: Path, tasks: int) -> str:
    report = api.evaluate(arithmetic(operations), str(model), out=out, rollout=rollout(operations), rewards=REWARDS,
                          device="cpu", num_tasks=tasks)
    return f"{report.success_rate:.3f} ({report.reward_components.get('progress', 0.0):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demos", type=int, default=500, help="reference demonstrations per operation count")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--hard", type=int, default=4, help="operations of the hard setting (2-5)")
    parser.add_argument("--first", type=int, default=2, help="operations of the curriculum's first stage")
    parser.add_argument("--steps", type=int, default=60, help="RL steps of each arm")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.15)
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-curriculum")
    args = parser.parse_args()
    if not 1 <= args.first < args.hard <= 5:
        parser.error(f"need 1 <= --first < --hard <= 5 (arithmetic's operations knob); got {args.first}, {args.hard}")
    configure(Verbosity.NORMAL)  # the console trajlab's commands have: one line per record, library noise off

    model = start_model(args)
    promote = {"metric": "train_success", "window": args.window, "threshold": args.threshold}
    curriculum = {"stages": [
        {"name": f"{ops} operations", "difficulty": {"operations": ops}, **limits(ops),
         **({"promote": promote} if ops < args.hard else {})} for ops in range(args.first, args.hard + 1)]}
    rows: dict[str, dict[str, Any]] = {"start": {"final": model}}
    for name, plan in (("direct", None), ("curriculum", curriculum)):
        rows[name] = train(model, args.work_dir / name, args, plan)
    horizons = range(1, args.hard + 1)
    for name, row in rows.items():
        for ops in horizons:
            row[f"{ops} ops"] = evaluate(row["final"], ops, args.work_dir / f"eval-{name}-{ops}", args.eval_tasks)

    print(f"\narithmetic: greedy success (progress) on {args.eval_tasks} held-out tasks per operation count; "
          f"{args.steps} RL steps x {args.tasks_per_step} tasks x {args.group_size} rollouts per arm, hard setting "
          f"{args.hard} operations; start model {model}")
    columns = [f"{ops} ops" for ops in horizons] + ["steps per stage", "flat groups", "wall_s"]
    print("| arm | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in rows.items():
        cells = [f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    promoted = (args.work_dir / "curriculum" / "curriculum.jsonl").read_text().strip()
    print("curriculum promotions:", *(promoted.splitlines() or ["none"]), sep="\n  ")


if __name__ == "__main__":
    main()
