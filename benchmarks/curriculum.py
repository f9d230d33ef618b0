"""A curriculum against direct RL at the same budget: which one reaches the hard setting?

    python benchmarks/curriculum.py                   # seeds 0-9, each a start model then both arms: ~80 min
    python benchmarks/curriculum.py --seeds 0 --demos 16 --sft-steps 2 --steps 2 --tasks-per-step 2 \\
        --group-size 2                                 # a smoke run of the whole script

The setting is the quickstart's (``arithmetic``, ``Compute (a op b) op c.``), and what is hard is keeping the minus
sign of a negative product: ``(3 - 7) * 8`` is -32, not 32. The start model of each seed learned it from a
demonstrator that drops that sign on *every* two-digit negative product and on ``--easy-slip`` of the one-digit ones
(by a hash of the question, as the quickstart's ``sign_slip`` reference does), trained the quickstart's way (``--demos``
demonstrations, failures included; SFT ``--sft-steps`` steps at 3e-3, cosine). So its samples keep the sign now and
then on one-digit products and almost never on two-digit ones: the hard setting's missing step is one RL would
reinforce if it ever saw it rewarded, and on the one-digit look-alikes it does see it.

Both arms start from that model and get the same ``--steps`` RL steps of ``--tasks-per-step`` x ``--group-size``
rollouts (the quickstart's rewards, credit and estimator; rate ``--learning-rate``, constant), so the same number of
episodes:

- direct: every step on the hard setting, the train tasks ``(a - b) * c`` with a two-digit negative result;
- curriculum: the one-digit ones first, promoted to the hard setting when the success of the stage's last
  ``--window`` steps reaches ``--threshold``.

Each arm is a ``curriculum:`` of trajlab's RL (one stage for direct), with task filters on the tasks' fields. Then the
start model and both arms are evaluated greedily on every held-out task of each kind (24 one-digit, 36 two-digit).
Reported per seed: held-out success on both kinds, the step at which each arm's train success on the hard setting
first reached 0.5 (over its last ``--window`` steps), the steps per stage, and the seconds its steps took (rollouts
and updates). ``--work-dir`` keeps the start models and runs, which a second call resumes (and reports again): give
another one for other settings.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import trajlab
from trajlab.cli.output import Verbosity, configure
from trajlab.env.builtin import arithmetic
from trajlab.env.registry import EnvSpec, Oracle, load_env
from trajlab.models.tiny import init_tiny_model
from trajlab.train.curriculum import matches

REWARDS = {"env": 1.0, "progress": 1.0}
ROLLOUT = {"max_turns": 6, "max_new_tokens": 40, "max_episode_tokens": 512, "concurrency": 64}  # the quickstart's
NEGATIVE_PRODUCTS = sorted({(a - b) * c for a in range(1, 10) for b in range(a + 1, 10) for c in range(1, 10)})
KINDS = {"one-digit": [v for v in NEGATIVE_PRODUCTS if v > -10],
         "two-digit": [v for v in NEGATIVE_PRODUCTS if v <= -10]}


def task_filter(kind: str) -> dict[str, Any]:
    """The tasks ``(a - b) * c`` whose result is a negative product of ``kind``."""
    return {"ops": [["subtract", "multiply"]], "answer": KINDS[kind]}


def demonstrator(easy_slip: float) -> Oracle:
    """The arithmetic reference, but submitting a negative product without its sign: always when it has two digits,
    on a share ``easy_slip`` of the one-digit ones (which ones: a hash of the question, the same in every run)."""

    def act(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        slipped = task["answer"] <= -10 or arithmetic.slips(task["question"], easy_slip)  # abs: no-op on the rest
        return arithmetic.oracle_dropping_sign(task, messages, slipped)

    return act


def start_model(env: EnvSpec, seed: int, args: argparse.Namespace) -> Path:
    """The quickstart's SFT on the demonstrator's episodes, failures included (resumed from ``--work-dir``)."""
    work = args.work_dir / f"seed{seed}" / "start"
    final = work / "sft" / "final"
    if (final / "config.json").exists():
        return final
    base = init_tiny_model(work / "model", seed=seed, overwrite=True)
    demos = trajlab.collect(env, "oracle", out=work / "demos.jsonl", tokenizer=str(base), episodes=args.demos,
                        rollout=ROLLOUT, seed=seed, reference="magnitude_slip")
    return trajlab.sft(base, demos, work / "sft", device="cpu", max_steps=args.sft_steps, batch_size=8,
                   learning_rate=3e-3, lr_scheduler="cosine", warmup_steps=min(10, args.sft_steps),
                   save_steps=args.sft_steps, seed=seed, dataset={"include_failures": True})


def train(model: Path, env: EnvSpec, out: Path, seed: int, args: argparse.Namespace,
          stages: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's RL run (resumed if ``out`` holds one): when it reached the hard setting, and its steps per stage."""
    trajlab.rl(model, env, out, device="cpu", seed=seed, resume=True, rollout=ROLLOUT, curriculum={"stages": stages},
           steps=args.steps, tasks_per_step=args.tasks_per_step, group_size=args.group_size,
           save_steps=args.steps, estimator="grpo", credit="turn", rewards=REWARDS,
           learning_rate=args.learning_rate, warmup_steps=min(2, args.steps), lr_scheduler="constant")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stage_of = [int(r.get("curriculum/stage", 0)) for r in records]
    hard = len(stages) - 1
    rates = [r["rollout/success_rate"] if s == hard else None for r, s in zip(records, stage_of, strict=True)]
    reached = next((i + 1 for i in range(args.window - 1, len(rates)) if None not in rates[i + 1 - args.window:i + 1]
                    and sum(rates[i + 1 - args.window:i + 1]) / args.window >= 0.5), None)
    seconds = sum(r["perf/rollout_s"] + r["perf/update_s"] for r in records)
    return {"final": out / "final", "rl_s": f"{seconds:.0f}", "reached at step": reached or "-",
            "steps per stage": "/".join(str(stage_of.count(i)) for i in range(len(stages)))}


def evaluate(env: EnvSpec, model: Path, tasks: list[dict[str, Any]], out: Path) -> float:
    return trajlab.evaluate(env, str(model), tasks=tasks, out=out, rollout=ROLLOUT, rewards=REWARDS, device="cpu",
                        temperature=0.0).success_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--demos", type=int, default=1000, help="the quickstart's demonstrations")
    parser.add_argument("--sft-steps", type=int, default=600, help="the quickstart's SFT steps")
    parser.add_argument("--easy-slip", type=float, default=0.5, help="share of one-digit negative products slipped")
    parser.add_argument("--steps", type=int, default=30, help="RL steps of each arm")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="the quickstart's RL rate")
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-curriculum")
    args = parser.parse_args()
    configure(Verbosity.NORMAL)  # the console trajlab's commands have: one line per record, library noise off

    env = replace(load_env("arithmetic"), references={"magnitude_slip": demonstrator(args.easy_slip)})
    promote = {"metric": "train_success", "window": args.window, "threshold": args.threshold}
    arms = {"direct": [{"name": "two-digit", "task_filter": task_filter("two-digit")}],
            "curriculum": [{"name": "one-digit", "task_filter": task_filter("one-digit"), "promote": promote},
                           {"name": "two-digit", "task_filter": task_filter("two-digit")}]}
    heldout = {kind: [task for task in env.iter_tasks("test", 0) if matches(task, task_filter(kind))] for kind in KINDS}
    columns = ["one-digit", "two-digit", "reached at step", "steps per stage", "rl_s"]
    lines = []
    for seed in args.seeds:
        model = start_model(env, seed, args)
        rows: dict[str, dict[str, Any]] = {"start": {"final": model}}
        for name, stages in arms.items():
            rows[name] = train(model, env, args.work_dir / f"seed{seed}" / name, seed, args, stages)
        for name, row in rows.items():
            for kind, tasks in heldout.items():
                row[kind] = evaluate(env, row["final"], tasks, args.work_dir / f"seed{seed}" / f"eval-{name}-{kind}")
            cells = [f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in columns]
            lines.append(f"| {seed} | {name} | " + " | ".join(cells) + " |")
        print("\n".join(lines[-3:]), flush=True)

    print(f"\narithmetic, negative products (a - b) * c: greedy success on every held-out task of each kind; "
          f"{args.steps} RL steps x {args.tasks_per_step} tasks x {args.group_size} rollouts per arm; reached: the "
          f"step at which the hard setting's train success over {args.window} steps first reached 0.5")
    print("| seed | arm | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
