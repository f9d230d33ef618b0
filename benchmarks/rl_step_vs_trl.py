"""Wall time of an RL step, trajlab vs TRL's GRPOTrainer: same tiny model, env, batch shape and machine.

    python benchmarks/rl_step_vs_trl.py --steps 5 --tasks-per-step 8 --group-size 8 --max-new-tokens 40 --max-turns 4
    python benchmarks/rl_step_vs_trl.py --quick          # smoke check: 1 step, tiny shapes

What runs, top to bottom:
1. prepare (untimed, cached in ``--work-dir``): build the tiny model with ``init_tiny_model(seed)`` and, unless
   ``--sft-steps 0``, fine-tune it briefly on reference demonstrations. A randomly initialised model never writes a
   parseable tool call, so without this both frameworks would time single-turn generation only.
2. each framework in its own subprocess, one after the other, so neither disturbs the other's timing:
   - trajlab: ``trajlab.rl`` (rollouts with the trajlab engine, then a clipped policy-gradient update);
   - TRL: ``GRPOTrainer`` with the same env class as ``environment_factory`` (TRL calls ``reset(**row)``), the same
     train tasks, in the same order, as dataset rows; tool calls parsed through ``tokenizer.response_template``.
   Both: ``tasks_per_step x group_size`` rollouts per step and one optimizer step on all of them, the same learning
   rate, temperature 1.0 (top-p 1, no top-k), no KL term, GRPO loss (mean over each sequence's tokens), at most
   ``max_new_tokens`` per model turn and ``max_turns`` model turns, on the CPU here (``benchmarks/gpu/rl_step.py``
   runs these workers on a GPU in bfloat16). A warm-up step runs first and is excluded; model loading and trainer
   construction are reported separately, checkpoint writing not at all.
3. a table: seconds per step, split into rollouts and the rest (mostly the update), generated tokens per step and per
   second, the share of groups whose rollouts all got the same reward (no gradient signal), tool calls and
   ``model.generate`` calls per step, and TRL / trajlab ratios. Per-step records go to ``<work-dir>/results.json``.

Counted the same way for both: tool calls inside the env (a subclass counts every call that reaches a tool), and,
where each framework calls ``model.generate``, the calls, the prompt tokens each call feeds through the model
("prefill tokens") and the tokens it decodes up to each row's stop token ("generated tokens"). TRL re-prefills the
whole history on every turn; trajlab keeps each episode's key/value states and feeds only what is new. In the
update, TRL runs every rollout through the model; trajlab skips rollouts whose advantage is zero on every token
(groups with equal rewards, the "flat groups" column), which contribute no gradient without a KL term, so the update
share of the gap depends on that column.

The frameworks end episodes differently, so equal limits need not mean equal tokens; compare generated tokens per
step next to seconds per step. TRL keeps generating after ``submit`` (it has no ``done``), ends an episode at the
first turn without a parseable call (trajlab answers a malformed call with an error note and goes on), and runs tools
after all but the last turn (``max_tool_calling_iterations = max_turns - 1`` gives both ``max_turns`` model turns).

On a machine where other work is running, ``--threads 1`` keeps torch's threads from stalling on each other; on a
quiet machine leave the default and record the machine next to the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trajlab.config import RLSettings, RolloutSettings
from trajlab.env.builtin.arithmetic import SPEC, Arithmetic

FRAMEWORKS = ("trajlab", "trl")
COUNTERS = ("tool_calls", "generate_calls", "sequences", "prefill_tokens", "generated_tokens")
Probe = Callable[[str], dict[str, float]]
"""Extra numbers a worker records at the end of every step, given the device (the GPU benchmark's peak memory)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """What both frameworks must agree on. ``steps`` are the timed steps; one warm-up step runs before them."""

    steps: int
    tasks_per_step: int
    group_size: int
    max_new_tokens: int
    max_turns: int
    learning_rate: float
    seed: int
    device: str = "cpu"
    dtype: str = "float32"  # what the model is loaded and trained in, by both
    budget_s: float | None = None  # a worker stops after the first step past this many seconds (at least 2 steps)
    tool_latency_s: float = 0.0  # every tool call sleeps this long first
    micro_batch_tokens: int | None = None  # trajlab's update: padded tokens per forward/backward (None: by rollouts)

    @property
    def rollouts(self) -> int:
        return self.tasks_per_step * self.group_size

    @property
    def total_steps(self) -> int:
        return self.steps + 1


class OutOfTime(Exception):
    """Raised from a step's callback to end a synchronous ``trajlab.rl`` run early: no rollouts are in flight then."""


def over_budget(budget_s: float | None, started: float, steps_done: int) -> bool:
    """Whether a run that began at ``started`` should stop after its ``steps_done``-th step (it keeps 2)."""
    return budget_s is not None and steps_done >= 2 and time.perf_counter() - started > budget_s


class CountingArithmetic(Arithmetic):
    """The arithmetic env counting the tool calls it executes, process-wide (every tool scores its step), each first
    sleeping ``latency_s`` (``Shape.tool_latency_s``), as a sandbox or an API would."""

    executed = 0
    latency_s = 0.0
    _lock = threading.Lock()

    def _score_step(self, name: str, arguments: dict[str, int]) -> None:
        time.sleep(CountingArithmetic.latency_s)
        with CountingArithmetic._lock:
            CountingArithmetic.executed += 1
        super()._score_step(name, arguments)


class Meter:
    """Cumulative counters of one worker, snapshotted at the end of every step."""

    def __init__(self, device: str, probe: Probe | None = None) -> None:
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.rollout_s = 0.0
        self.steps: list[dict[str, Any]] = []
        self.device, self.probe = device, probe

    def generated(self, prefill_tokens: int, completions: list[list[int]]) -> None:
        """One ``model.generate`` call: the prompt tokens it fed through the model and its rows' decoded tokens."""
        self.totals["generate_calls"] += 1
        self.totals["sequences"] += len(completions)
        self.totals["prefill_tokens"] += prefill_tokens
        self.totals["generated_tokens"] += sum(len(c) for c in completions)

    def step_end(self, **extra: Any) -> None:
        self.totals["tool_calls"] = CountingArithmetic.executed
        probed = self.probe(self.device) if self.probe else {}
        self.steps.append({"end": time.perf_counter(), "rollout_total_s": self.rollout_s, **self.totals, **extra,
                           **probed})

    def per_step(self, started: float) -> list[dict[str, Any]]:
        """Per-step differences of the cumulative values; the first step's wall time counts from ``started``."""
        previous = {"end": started, "rollout_total_s": 0.0, **dict.fromkeys(COUNTERS, 0)}
        out = []
        for step in self.steps:
            row = {key: value for key, value in step.items() if key not in ("end", "rollout_total_s")}
            row["wall_s"] = step["end"] - previous["end"]
            row["rollout_s"] = step["rollout_total_s"] - previous["rollout_total_s"]
            row.update({key: step[key] - previous[key] for key in COUNTERS})
            out.append(row)
            previous = step
        return out


def train_tasks(shape: Shape) -> list[dict[str, Any]]:
    """The tasks of all steps in the order ``trajlab.rl`` draws them (train split, seeded order)."""
    return list(itertools.islice(SPEC.iter_tasks("train", shape.seed), shape.tasks_per_step * shape.total_steps))


# --- workers: each runs in its own process and returns {setup_s, steps: [...]} ---


def trajlab_settings(shape: Shape, **changes: Any) -> tuple[RLSettings, RolloutSettings]:
    """``trajlab.rl``'s settings for ``shape`` (``changes``: other ``RLSettings`` fields), as TRL is configured."""
    settings = RLSettings(**{
        "steps": shape.total_steps, "tasks_per_step": shape.tasks_per_step, "group_size": shape.group_size,
        "estimator": "grpo", "credit": "trajectory", "rewards": {"env": 1.0}, "learning_rate": shape.learning_rate,
        "temperature": 1.0, "kl_coef": 0.0, "epochs_per_step": 1, "minibatch_size": shape.rollouts,
        "save_steps": 10**9, "micro_batch_tokens": shape.micro_batch_tokens, **changes,
    })
    rollout = RolloutSettings(max_turns=shape.max_turns, max_new_tokens=shape.max_new_tokens,
                              max_episode_tokens=4096, concurrency=shape.rollouts)
    return settings, rollout


def run_trajlab(shape: Shape, model_dir: Path, out_dir: Path, probe: Probe | None = None) -> dict[str, Any]:
    import trajlab
    from trajlab.inference.hf import HFGenerator
    from trajlab.models.loading import load_tokenizer

    meter = Meter(shape.device, probe)
    generate_batch = HFGenerator._generate_batch

    def measured_generate_batch(self, requests, abandoned):  # instrumentation only: the same call, counted
        fed_before = self.fed_tokens
        results = generate_batch(self, requests, abandoned)
        meter.generated(self.fed_tokens - fed_before, [r.token_ids for r in results])
        return results

    HFGenerator._generate_batch = measured_generate_batch

    settings, rollout = trajlab_settings(shape)

    def on_step(record: dict[str, float]) -> None:  # after the update, before any checkpoint is written
        meter.rollout_s += record["perf/rollout_s"]
        meter.step_end(reward=record["reward/mean"], update_s=record["perf/update_s"],
                       flat_groups=record["rollout/zero_variance_groups"],
                       framework_tokens=record["perf/tokens_per_s"] * record["perf/rollout_s"])
        if over_budget(shape.budget_s, started, len(meter.steps)):
            raise OutOfTime

    started = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    env = dataclasses.replace(SPEC, env_cls=CountingArithmetic)
    with contextlib.suppress(OutOfTime):
        trajlab.rl(model_dir, env, out_dir, tokenizer=tokenizer, rollout=rollout, seed=shape.seed, on_step=on_step,
                   device=shape.device, dtype=shape.dtype, **settings.model_dump())
    steps = meter.per_step(started)
    # trajlab.rl loads the model and builds its engine before step 1: setup is what step 1 took beyond its own work.
    setup_s = steps[0]["wall_s"] - steps[0]["rollout_s"] - steps[0]["update_s"]
    steps[0]["wall_s"] -= setup_s
    return {"setup_s": setup_s, "steps": steps}


def run_trl(shape: Shape, model_dir: Path, out_dir: Path, probe: Probe | None = None) -> dict[str, Any]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trajlab.models.loading import load_model, load_tokenizer

    meter = Meter(shape.device, probe)
    logged: list[dict[str, float]] = []

    def env_reward(environments: list[CountingArithmetic], **_: Any) -> list[float]:
        return [float(env.reward) for env in environments]

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # after the optimizer step, before logging
            meter.step_end()
            control.should_training_stop |= over_budget(shape.budget_s, train_started, len(meter.steps))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                logged.append(dict(logs))

    started = time.perf_counter()
    # TRL appends reset()'s observation to the last prompt message: the empty user turn becomes the question.
    prompt = [{"role": "system", "content": SPEC.system_prompt}, {"role": "user", "content": ""}]
    dataset = Dataset.from_list([{**task, "prompt": prompt} for task in train_tasks(shape)])
    args = GRPOConfig(
        output_dir=str(out_dir), seed=shape.seed, report_to="none", save_strategy="no", logging_steps=1,
        # the model is loaded in shape.dtype; bf16 also runs TRL's forward passes under bfloat16 autocast
        use_cpu=shape.device == "cpu", bf16=shape.dtype == "bfloat16",
        disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False,
        max_steps=shape.total_steps, per_device_train_batch_size=shape.rollouts, gradient_accumulation_steps=1,
        num_generations=shape.group_size, num_iterations=1,
        learning_rate=shape.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, loss_type="grpo", scale_rewards="group",
        temperature=1.0, top_p=1.0, top_k=0,
        # max_completion_length is TRL's budget for all turns together (model and tool tokens): make it loose. The
        # per-turn cap is generation's max_new_tokens; the turn cap counts tool-calling rounds after the first turn.
        max_completion_length=shape.max_turns * (shape.max_new_tokens + 64),
        generation_kwargs={"max_new_tokens": shape.max_new_tokens},
        max_tool_calling_iterations=shape.max_turns - 1,
    )
    trainer = GRPOTrainer(
        model=load_model(model_dir, device=shape.device, dtype=shape.dtype), reward_funcs=[env_reward], args=args,
        train_dataset=dataset, processing_class=load_tokenizer(model_dir), environment_factory=CountingArithmetic,
        callbacks=[StepClock()],
    )
    generate, generate_single_turn = trainer._generate, trainer._generate_single_turn

    def timed_generate(prompts):  # instrumentation only: the rollout (all turns and tool calls), timed
        began = time.perf_counter()
        try:
            return generate(prompts)
        finally:
            meter.rollout_s += time.perf_counter() - began

    def counted_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completion_ids, logprobs = generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                        has_tool_images)
        if len(completion_ids) != len(prompt_ids):  # a backend that samples num_generations per prompt itself
            prompt_ids = [ids for ids in prompt_ids for _ in range(num_generations)]
        meter.generated(sum(len(p) for p in prompt_ids), completion_ids)
        return completion_ids, logprobs

    trainer._generate, trainer._generate_single_turn = timed_generate, counted_single_turn
    setup_s = time.perf_counter() - started
    train_started = time.perf_counter()
    trainer.train()
    steps = meter.per_step(train_started)
    for step, logs in zip(steps, logged, strict=False):
        step["reward"] = logs.get("reward", math.nan)
        step["flat_groups"] = logs.get("frac_reward_zero_std", math.nan)
        step["framework_tokens"] = logs["completions/mean_length"] * shape.rollouts
        step["trl_tool_call_frequency"] = logs.get("tools/call_frequency", math.nan)
    return {"setup_s": setup_s, "steps": steps}


WORKERS = {"trajlab": run_trajlab, "trl": run_trl}


# --- the driver: prepare once, one subprocess per framework, then the table ---


def prepare_model(work_dir: Path, seed: int, sft_steps: int) -> Path:
    """The benchmark model: ``init_tiny_model(seed)``, then ``sft_steps`` of SFT on reference demos (cached)."""
    import trajlab
    from trajlab.data.store import read_trajectories
    from trajlab.models.tiny import init_tiny_model

    base = work_dir / f"tiny-seed{seed}"
    if not (base / "config.json").exists():
        init_tiny_model(base, seed=seed, overwrite=True)
    if sft_steps == 0:
        return base
    tuned = work_dir / f"tiny-seed{seed}-sft{sft_steps}"
    if not (tuned / "config.json").exists():
        demos = work_dir / f"demos-seed{seed}.jsonl"  # other task order than the benchmark's (seed + 1)
        trajlab.collect(SPEC, "oracle", out=demos, episodes=8 * sft_steps, seed=seed + 1, tokenizer=str(base),
                        rollout={"concurrency": 64})
        sft_warm_start(base, tuned, list(read_trajectories(demos))[: 8 * sft_steps], sft_steps, seed)
    return tuned


def sft_warm_start(base: Path, out: Path, demos: list[Any], steps: int, seed: int, batch_size: int = 8,
                   learning_rate: float = 3e-3) -> None:
    """Next-token loss on the demos' model tokens only: enough for the tiny model to write tool calls."""
    import torch

    from trajlab.models.loading import load_model, load_tokenizer

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(base)
    model = load_model(base).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    rows = [(t.tokens.prompt_ids + t.tokens.completion_ids, [0] * len(t.tokens.prompt_ids) + t.tokens.loss_mask)
            for t in demos]
    began = time.perf_counter()
    for step in range(steps):
        batch = [rows[(step * batch_size + i) % len(rows)] for i in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])  # (B, T)
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask, strict=True)] + [-100] * (width - len(ids))
                               for ids, mask in batch])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        optimizer.zero_grad()
        if (step + 1) % max(1, steps // 5) == 0:
            print(f"[prepare] sft step {step + 1}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - began:.0f}s)",
                  flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def run_worker(framework: str, shape: Shape, model_dir: Path, out_dir: Path, threads: int,
               script: Path = Path(__file__)) -> dict[str, Any]:
    """Run one framework in a fresh interpreter (``script``'s ``--worker``) and read back its result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result_file = out_dir / "result.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(script), "--worker", framework, "--shape", json.dumps(dataclasses.asdict(shape)),
               "--model", str(model_dir), "--out", str(out_dir), "--threads", str(threads)]
    began = time.perf_counter()
    subprocess.run(command, check=True)
    result = json.loads(result_file.read_text())
    result["process_s"] = time.perf_counter() - began
    return result


def summarize(framework: str, result: dict[str, Any],
              average: Callable[[list[float]], float] = statistics.mean) -> dict[str, Any]:
    """Each per-step number ``average``d over the timed steps (the warm-up step excluded): means here, medians in
    the GPU benchmark; rates are the averaged tokens over the averaged seconds. A probed peak is the timed steps'
    highest."""
    timed = result["steps"][1:]

    def per_step(key: str) -> float:
        return average([s.get(key, math.nan) for s in timed])

    wall, rollout, generated = per_step("wall_s"), per_step("rollout_s"), per_step("generated_tokens")
    return {
        "framework": framework, "steps": len(timed), "s_per_step": wall, "rollout_s_per_step": rollout,
        "rest_s_per_step": average([s["wall_s"] - s["rollout_s"] for s in timed]),
        "generated_per_step": generated, "generated_per_s": generated / wall,
        "rollout_tokens_per_s": generated / rollout if rollout else math.nan,
        "tool_calls_per_step": per_step("tool_calls"), "model_turns_per_step": per_step("sequences"),
        "generate_calls_per_step": per_step("generate_calls"), "prefill_per_step": per_step("prefill_tokens"),
        "reward": per_step("reward"), "flat_groups": per_step("flat_groups"),
        "peak_gb": max((s["peak_gb"] for s in timed if "peak_gb" in s), default=math.nan),
        "setup_s": result["setup_s"], "warmup_s": result["steps"][0]["wall_s"]}


COLUMNS = (  # (header, key, format)
    ("framework", "framework", "{}"), ("steps", "steps", "{}"), ("s/step", "s_per_step", "{:.2f}"),
    ("rollout s/step", "rollout_s_per_step", "{:.2f}"), ("update+rest s/step", "rest_s_per_step", "{:.2f}"),
    ("gen tok/step", "generated_per_step", "{:.0f}"), ("gen tok/s", "generated_per_s", "{:.0f}"),
    ("gen tok/s in rollout", "rollout_tokens_per_s", "{:.0f}"), ("tool calls/step", "tool_calls_per_step", "{:.1f}"),
    ("generate calls/step", "generate_calls_per_step", "{:.1f}"), ("prefill tok/step", "prefill_per_step", "{:.0f}"),
    ("reward", "reward", "{:.3f}"), ("flat groups", "flat_groups", "{:.0%}"), ("setup s", "setup_s", "{:.1f}"),
    ("warm-up s", "warmup_s", "{:.1f}"),
)
RATIOS = ("s_per_step", "rollout_s_per_step", "rest_s_per_step", "generated_per_step", "generated_per_s",
          "rollout_tokens_per_s", "prefill_per_step")


def table(rows: list[dict[str, Any]], columns: tuple[tuple[str, str, str], ...] = COLUMNS,
          ratios: tuple[str, ...] = RATIOS) -> str:
    """A Markdown table of ``summarize``'s rows, ``columns`` as (header, key, format), and a TRL / trajlab row of
    the ``ratios`` keys."""
    cells = [[header for header, _, _ in columns]]
    cells += [[fmt.format(row[key]) for _, key, fmt in columns] for row in rows]
    by_name = {row["framework"]: row for row in rows}
    if set(by_name) == set(FRAMEWORKS):
        trajlab, trl = by_name["trajlab"], by_name["trl"]
        ratio = ["trl/trajlab"] + ["" for _ in columns[1:]]
        for index, (_, key, _) in enumerate(columns):
            if key in ratios and trajlab[key]:
                ratio[index] = f"{trl[key] / trajlab[key]:.2f}x"
        cells.append(ratio)
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |"
             for row in cells]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed RL steps (after one warm-up step)")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per task (TRL's num_generations)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens per model turn")
    parser.add_argument("--max-turns", type=int, default=4, help="model turns per episode")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=150,
                        help="SFT steps on reference demos before timing, so the model makes tool calls (0: the "
                             "freshly initialised model, which makes none)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads in every process (0: torch's default); on a busy machine 1 avoids "
                             "threads stalling on each other")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated subset to run")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench_rl_step_vs_trl"))
    parser.add_argument("--quick", action="store_true", help="smoke check: 1 step, 2 tasks x 2 rollouts, 3 turns")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.tasks_per_step, args.group_size, args.max_new_tokens, args.max_turns = 1, 2, 2, 32, 3
    if min(args.steps, args.tasks_per_step, args.max_new_tokens, args.max_turns) < 1 or args.group_size < 2:
        parser.error("--steps, --tasks-per-step, --max-new-tokens and --max-turns must be >= 1, --group-size >= 2")
    return args


def main(argv: list[str] | None = None, probe: Probe | None = None) -> None:
    """The benchmark, or (``--worker``) one framework's run inside its process, calling ``probe`` every step."""
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:  # inside a worker process
        shape = Shape(**json.loads(args.shape))
        CountingArithmetic.latency_s = shape.tool_latency_s
        result = WORKERS[args.worker](shape, args.model, args.out, probe)
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
        return

    shape = Shape(steps=args.steps, tasks_per_step=args.tasks_per_step, group_size=args.group_size,
                  max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, learning_rate=args.learning_rate,
                  seed=args.seed)
    frameworks = [name for name in args.frameworks.split(",") if name]
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        raise SystemExit(f"unknown framework(s) {unknown}; choose from {list(FRAMEWORKS)}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args.work_dir, args.seed, args.sft_steps)
    threads = args.threads or "torch default"
    print(f"model: {model_dir}\nshape: {dataclasses.asdict(shape)}\ncores: {os.cpu_count()}, torch threads: {threads}",
          flush=True)

    results = {}
    for framework in frameworks:
        print(f"--- {framework}: {shape.total_steps} steps (1 warm-up) ---", flush=True)
        results[framework] = run_worker(framework, shape, model_dir, args.work_dir / framework, args.threads)
    rows = [summarize(name, result) for name, result in results.items()]
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "shape": dataclasses.asdict(shape),
              "sft_steps": args.sft_steps, "threads": args.threads, "cores": os.cpu_count(), "model": str(model_dir),
              "summary": rows, "runs": results}
    (args.work_dir / "results.json").write_text(json.dumps(report, indent=1))
    print()
    print(table(rows))
    tokens = [row["generated_per_step"] for row in rows]
    if len(tokens) == 2 and abs(tokens[0] - tokens[1]) > 0.1 * max(tokens):
        print("\nnote: the frameworks generated different numbers of tokens per step (see the module docstring for "
              "why); compare generated tokens/s as well as s/step.")
    print(f"\nper-step records: {args.work_dir / 'results.json'}")


if __name__ == "__main__":
    main()
