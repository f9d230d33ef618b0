"""`trajlab rl` and `trajlab sft` in two processes (`accelerate launch --multi_gpu --num_processes 2` on a machine
without GPUs: torchrun, gloo), against one process.

Real processes: the commands run as a user would launch them, and what they log and save is compared with the same
command run in one process. (``accelerate launch --cpu --num_processes 2`` starts a single process unless MPI is
set up: accelerate's CPU path is its simple launcher; each test checks that two processes really ran.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trajlab.models.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
          "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "trajlab.cli"]
ONE = [sys.executable, "-m", "trajlab.cli"]


def run(command: list[str], cwd: Path, **env_vars: str) -> None:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} | env_vars
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def weights(path: Path) -> torch.Tensor:
    return torch.cat([tensor.flatten().float() for tensor in load_model(path).state_dict().values()])


def update_gap(start: Path, one: Path, two: Path) -> tuple[float, float]:
    """How far one process moved the weights (the largest change), and how far apart the two updates are, relative
    to the update's norm. Relative, not the largest entry: Adam's first steps are about lr * sign(gradient), so a
    weight whose gradient is near Adam's epsilon can move differently on reduction-order rounding alone (6e-5 of a
    1e-3 step, seen once in CI) while the update as a whole agrees to 1e-5; a real difference in the optimizer steps
    (one process at batch 2 takes four steps, not two) puts the updates 0.9 apart."""
    first = weights(one) - weights(start)
    second = weights(two) - weights(start)
    return first.abs().max().item(), ((first - second).norm() / first.norm()).item()


@pytest.mark.slow(28)
def test_rl_two_processes_match_one(terse_model_dir, tmp_path):
    """Three tasks over two processes (2 and 1: uneven rollouts), micro-batches of 4 (4 and then 12 sequences
    trained: 1 and 3 micro-batches, so one process runs a pass of weight zero), two steps with learning-rate
    warm-up: the same rollouts,
    the same learning rate each step (the scheduler steps once per optimizer step, not once per process), and the
    same weights at the end."""
    lr = 1e-3
    common = ["rl", "--model", str(terse_model_dir), "--env", "tests.rollout.length_env:SPEC", "--steps", "2",
              "--tasks-per-step", "3", "--group-size", "4", "--learning-rate", str(lr), "--device", "cpu",
              "--set", "rollout.max_turns=1", "--set", "rollout.max_new_tokens=48", "--set", "rollout.concurrency=8",
              "--set", "rl.warmup_steps=2", "--set", "rl.micro_batch_size=4", "--set", "rl.temperature=1.0",
              "--set", "rl.rewards={env: 1.0}", "--set", "rl.rate_by_failures=false",
              "--set", "rl.lr_scheduler=constant"]
    run([*ONE, *common, "--out", str(tmp_path / "one")], ROOT)
    run([*LAUNCH, *common, "--out", str(tmp_path / "two")], ROOT)
    steps = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
             for name in ("one", "two")}
    assert [s["perf/processes"] for s in steps["one"] + steps["two"]] == [1, 1, 2, 2]
    assert len(steps["two"]) == 2, "one process writes the metrics, once per step"
    for single, double in zip(steps["one"], steps["two"], strict=True):
        assert double["reward/mean"] == single["reward/mean"]
        assert double["rollout/mean_turns"] == single["rollout/mean_turns"]
        assert double["optim/trained_sequences"] == single["optim/trained_sequences"]
        assert double["optim/lr"] == pytest.approx(single["optim/lr"])
        assert double["loss/policy"] == pytest.approx(single["loss/policy"], rel=1e-4, abs=1e-6)
        # Adam's step hardly depends on the gradient's scale; its norm does: both processes' shares, summed once
        assert double["optim/grad_norm"] == pytest.approx(single["optim/grad_norm"], rel=1e-4)
        assert single["optim/grad_norm"] > 0
    assert [s["optim/lr"] for s in steps["one"]] == pytest.approx([lr / 3, 2 * lr / 3])
    assert sum(s["optim/trained_sequences"] for s in steps["one"]) > 0, "a real update"
    moved, apart = update_gap(terse_model_dir, tmp_path / "one" / "final", tmp_path / "two" / "final")
    # Adam moves each weight by about its learning rate whatever the gradient's scale; summing the gradient over
    # two processes instead of one changes it by rounding only
    assert moved > 0.5 * lr / 3 and apart < 1e-3, (moved, apart)


@pytest.mark.slow(72)
def test_rl_with_workers_in_two_processes_matches_one_and_a_killed_worker_costs_nothing(terse_model_dir, tmp_path):
    """``rollout.workers`` under ``accelerate launch``: the main process drives two Ray workers, which roll out every
    task, and both processes train on their share; the same rollouts, losses and weights as one process driving
    the same workers. A worker killed in the middle of the second step (its episode's reset SIGKILLs it) costs
    nothing: its episodes run again on the other worker or its replacement, none lost, none trained twice."""
    pytest.importorskip("ray")
    from ..rollout.dying_env import DRIVER, MARKER, TASK

    common = ["rl", "--model", str(terse_model_dir), "--env", "tests.rollout.dying_env:LENGTH", "--steps", "2",
              "--tasks-per-step", "2", "--group-size", "4", "--learning-rate", "1e-3", "--device", "cpu",
              "--set", "rollout.max_turns=1", "--set", "rollout.max_new_tokens=48", "--set", "rollout.concurrency=8",
              "--set", "rollout.workers=2", "--set", "rollout.retry_backoff_s=0.1", "--set", "rl.temperature=1.0",
              "--set", "rl.rewards={env: 1.0}"]
    run([*ONE, *common, "--out", str(tmp_path / "one")], ROOT)
    marker = tmp_path / "died"  # the second step's first task kills its worker; no trainer process runs an env
    run([*LAUNCH, *common, "--out", str(tmp_path / "two")], ROOT, **{MARKER: str(marker), DRIVER: "0",
                                                                      TASK: "train-2"})
    assert marker.exists(), "a worker was killed"
    steps = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
             for name in ("one", "two")}
    assert [s["perf/processes"] for s in steps["one"] + steps["two"]] == [1, 1, 2, 2]
    assert [s["rollout/workers_replaced"] for s in steps["two"]] == [0, 1]
    assert steps["two"][1]["rollout/retries"] >= 1 and steps["two"][1]["rollout/errors"] == 0, "run again"
    for single, double in zip(steps["one"], steps["two"], strict=True):
        assert double["reward/mean"] == single["reward/mean"]
        assert double["rollout/episodes"] == single["rollout/episodes"] == 8, "none lost, none twice"
        assert double["optim/trained_sequences"] == single["optim/trained_sequences"] > 0
        assert double["loss/policy"] == pytest.approx(single["loss/policy"], rel=1e-4, abs=1e-6)
        assert double["mismatch/abs_logprob"] < 1e-4, "the workers sampled from the trainer's weights"
    moved, apart = update_gap(terse_model_dir, tmp_path / "one" / "final", tmp_path / "two" / "final")
    assert moved > 0.5e-3 and apart < 1e-3, (moved, apart)


@pytest.mark.slow(34)
def test_sft_two_processes_match_one(tiny_model_dir, tmp_path):
    """The same optimizer steps over the same sequences: 8 demonstrations, 4 a step in one process, 2 a step in
    each of two (the per-device batch), two steps. Had one process run with batch 2, it would take four steps."""
    demos = tmp_path / "demos.jsonl"
    run([*ONE, "collect", "--env", "arithmetic", "--policy", "oracle", "--tokenizer", str(tiny_model_dir),
         "--episodes", "8", "--out", str(demos)], ROOT)
    common = ["sft", "--model", str(tiny_model_dir), "--from", str(demos), "--epochs", "1", "--device", "cpu",
              "--set", "sft.warmup_steps=0", "--set", "sft.lr_scheduler=constant", "--learning-rate", "1e-3"]
    run([*ONE, *common, "--batch-size", "4", "--out", str(tmp_path / "one")], ROOT)
    run([*LAUNCH, *common, "--batch-size", "2", "--out", str(tmp_path / "two")], ROOT)
    moved, apart = update_gap(tiny_model_dir, tmp_path / "one" / "final", tmp_path / "two" / "final")
    assert moved > 1e-3 and apart < 1e-3, (moved, apart)
