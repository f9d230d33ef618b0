"""Sharded RL (``rl.sharding: fsdp``, FSDP2) in two real processes (``accelerate launch``, gloo on CPU), against the
same run unsharded in one process, and a sharded run killed with SIGKILL and resumed against one left alone.

What the CPU cannot show (NCCL, memory per GPU on a real-size model) is the GPU measurement run's
(``benchmarks/gpu/run.sh``); the sharding itself (``fully_shard``, the gathers, distributed checkpoints) is the
same code on gloo.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader

import trajlab
from trajlab.errors import UserError
from trajlab.models.loading import load_model

from .test_multiprocess import LAUNCH, ONE, ROOT, run, update_gap

COMMON = ["--env", "tests.rollout.length_env:SPEC", "--tasks-per-step", "3", "--group-size", "4", "--device", "cpu",
          "--set", "rollout.max_turns=1", "--set", "rollout.max_new_tokens=48", "--set", "rollout.concurrency=8",
          "--set", "rl.micro_batch_size=4", "--set", "rl.temperature=1.0", "--set", "rl.rewards={env: 1.0}"]
SHARDED = ["--set", "rl.sharding=fsdp"]


def metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def one_and_two_sharded(command: list[str], tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """``command`` in one unsharded process and in two sharded ones; each run's steps, after checking that both
    logged every step with the same rollouts, losses and a sampler holding the trained weights."""
    run([*ONE, *command, "--out", str(tmp_path / "one")], ROOT)
    run([*LAUNCH, *command, *SHARDED, "--out", str(tmp_path / "two")], ROOT)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [s["perf/processes"] for s in one + two] == [1] * len(one) + [2] * len(two)
    for single, double in zip(one, two, strict=True):
        assert double["reward/mean"] == single["reward/mean"]
        assert double["optim/trained_sequences"] == single["optim/trained_sequences"]
        assert double["loss/policy"] == pytest.approx(single["loss/policy"], rel=1e-4, abs=1e-6)
        assert double["mismatch/abs_logprob"] < 1e-4, "the sampler sampled from the trained weights"
    return one, two


@pytest.mark.parametrize("variant", [
    pytest.param([], id="full-weights"),
    pytest.param(["--lora-r", "4", "--set", "rl.kl_coef=0.05", "--set", "rl.gradient_checkpointing=true"],
                 id="lora-kl-checkpointing"),
])
@pytest.mark.slow(38)
def test_sharded_rl_in_two_processes_matches_one_unsharded_process(terse_model_dir, tmp_path, variant):
    """Three tasks over two processes (uneven rollouts, one process running a pass of weight zero), two steps with
    warm-up: the same rollouts, losses, gradient norms and learning rates, the same weights at the end. The hf
    backend samples from each process's whole copy of the policy, which gets the trained weights gathered a layer
    at a time: its logprobs are the trainer's (the mismatch stays at rounding). With LoRA, the KL term's reference
    is the disabled adapter, and the adapter arrives in the copy and in ``final`` merged."""
    lr = 1e-3
    command = ["rl", "--model", str(terse_model_dir), *COMMON, "--steps", "2", "--learning-rate", str(lr),
               "--set", "rl.warmup_steps=2", *variant]
    one, two = one_and_two_sharded(command, tmp_path)
    assert len(one) == 2
    for single, double in zip(one, two, strict=True):
        assert double["optim/lr"] == pytest.approx(single["optim/lr"])
        assert double["optim/grad_norm"] == pytest.approx(single["optim/grad_norm"], rel=1e-4)
    assert sum(s["optim/trained_sequences"] for s in one) > 0 and one[0]["optim/grad_norm"] > 0, "a real update"
    moved, apart = update_gap(terse_model_dir, tmp_path / "one" / "final", tmp_path / "two" / "final")
    assert moved > 0.5 * lr / 3 and apart < 1e-3, (moved, apart)
    slices = sorted(p.name for p in (tmp_path / "two" / "checkpoint" / "sharded").glob("*.distcp"))
    assert slices == ["__0_0.distcp", "__1_0.distcp"], "each process checkpointed its own slices: it was sharded"


@pytest.mark.slow(60)
def test_a_sharded_run_killed_and_resumed_ends_as_one_left_alone(terse_model_dir, tmp_path):
    """Three steps, a checkpoint after each: one run left alone, one killed (SIGKILL, both processes and the
    launcher) once its first checkpoint is written, then resumed: the same metrics for every step and the same final
    weights, to the bit. Each process wrote and read only its own slices (``checkpoint/sharded``).

    One episode generates at a time: a batch's composition follows the episodes' timing, and a row's logprobs round
    differently with the rows beside it; the loss's ratio is taken against those logprobs, and AdamW turned that
    rounding into weights 5e-7 apart (10 of 294,912) on a loaded CI machine."""
    command = [*LAUNCH, "rl", "--model", str(terse_model_dir), *COMMON, "--steps", "3", "--learning-rate", "1e-3",
               "--set", "rl.save_steps=1", *SHARDED, "--set", "rollout.concurrency=1"]
    run([*command, "--out", str(tmp_path / "alone")], ROOT)
    killed = tmp_path / "killed"
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launched = subprocess.Popen([*command, "--out", str(killed)], cwd=ROOT, env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = killed / "checkpoint" / "trajlab_state.json"
    deadline = time.monotonic() + 300
    while not state.exists() and launched.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(launched.pid, signal.SIGKILL)
    launched.wait()
    assert not (killed / "final").exists(), "killed before the end"
    saved = json.loads(state.read_text())["step"]
    assert saved < 3 and (killed / "checkpoint" / "sharded").is_dir()
    run([*command, "--out", str(killed), "--resume"], ROOT)
    alone, resumed = metrics(tmp_path / "alone"), metrics(killed)
    assert [s["step"] for s in resumed] == [1, 2, 3]
    for left, again in zip(alone, resumed, strict=True):
        for key in ("reward/mean", "optim/trained_sequences", "optim/lr", "loss/policy", "optim/grad_norm"):
            assert again[key] == left[key], key
    for mine, theirs in zip(load_model(killed / "final").parameters(),
                            load_model(tmp_path / "alone" / "final").parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_sharded_bfloat16_policy_keeps_float32_master_slices_and_exports_bfloat16(terse_model_dir, tmp_path):
    """A bfloat16 model sharded computes in bfloat16 over float32 slices (the checkpoint holds float32 weights and
    AdamW moments), its whole copy samples from the gathered bfloat16 weights (the mismatch is bfloat16's, about
    2e-3, not a different policy's), and ``final`` is bfloat16 again, as an unsharded run writes it. Unlike float32,
    bfloat16 runs differ from one process's by the batch shapes each process generates with, so this is not compared
    with one."""
    out = tmp_path / "bf16"
    run([*LAUNCH, "rl", "--model", str(terse_model_dir), *COMMON, "--steps", "2", "--learning-rate", "1e-3",
         "--dtype", "bfloat16", *SHARDED, "--out", str(out)], ROOT)
    steps = metrics(out)
    assert all(0 < s["mismatch/abs_logprob"] < 1e-2 for s in steps) and steps[0]["optim/grad_norm"] > 0
    saved = FileSystemReader(str(out / "checkpoint" / "sharded")).read_metadata().state_dict_metadata
    weights = {key: meta for key, meta in saved.items() if key.startswith("model.")}
    moments = [meta for key, meta in saved.items() if key.endswith(".exp_avg")]
    assert weights and moments and {m.properties.dtype for m in [*weights.values(), *moments]} == {torch.float32}
    with safe_open(out / "final" / "model.safetensors", "pt") as written:
        names = written.keys()
        assert {written.get_slice(name).get_dtype() for name in names} == {"BF16"}
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    final = load_model(out / "final")
    moved = (torch.cat([p.flatten().float() for p in final.parameters()])
             - torch.cat([p.flatten().float() for p in load_model(terse_model_dir).parameters()])).abs().max()
    assert moved > 0, "trained"


@pytest.mark.slow(46)
def test_sharded_training_drives_rollout_workers_from_the_main_process(terse_model_dir, tmp_path):
    """``rollout.workers`` with two sharded trainer processes: the main process drives the worker, and both take
    part in gathering the weights it is sent after each update (the other process keeps none); the same rollouts,
    losses and weights as one unsharded process driving the same worker."""
    pytest.importorskip("ray")
    command = ["rl", "--model", str(terse_model_dir), *COMMON, "--steps", "2", "--learning-rate", "1e-3",
               "--set", "rollout.workers=1"]
    one, _ = one_and_two_sharded(command, tmp_path)
    assert len(one) == 2
    assert sum(s["optim/trained_sequences"] for s in one) > 0
    moved, apart = update_gap(terse_model_dir, tmp_path / "one" / "final", tmp_path / "two" / "final")
    assert moved > 0.5e-3 / 3 and apart < 1e-3, (moved, apart)


@pytest.mark.parametrize(("settings", "refusal"), [
    ({}, r"this run has one: launch several \(accelerate launch"),
    ({"max_staleness": 1}, r"max_staleness > 0 needs a sampler with weights of its own"),
    ({"vllm": {"server": "http://127.0.0.1:9/v1"}}, r"does not drive model.vllm.server yet"),
])
def test_what_sharding_does_not_do_is_refused_before_any_model_loads(tiny_model_dir, tmp_path, settings, refusal):
    """One process (nothing to shard over), asynchronous rollouts on the hf backend (its copy is refreshed between
    steps only), a ``vllm serve`` sampler (not yet): each stops with what to do instead."""
    vllm = settings.pop("vllm", None)
    with pytest.raises(UserError, match=refusal):
        trajlab.rl(tiny_model_dir, "arithmetic", tmp_path, sharding="fsdp", steps=1, vllm=vllm,
                   backend="vllm" if vllm else None, **settings)


def sft_command(model: Path, demos: Path, *extra: str) -> list[str]:
    return ["sft", "--model", str(model), "--from", str(demos), "--epochs", "1", "--device", "cpu", "--set",
            "sft.warmup_steps=0", "--set", "sft.lr_scheduler=constant", "--set", "sft.logging_steps=1",
            "--learning-rate", "1e-3", *extra]


@pytest.fixture(scope="module")
def demos(tiny_model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demos") / "demos.jsonl"
    run([*ONE, "collect", "--env", "arithmetic", "--policy", "oracle", "--tokenizer", str(tiny_model_dir),
         "--episodes", "8", "--out", str(path)], ROOT)
    return path


@pytest.mark.parametrize("variant", [
    pytest.param([], id="full-weights"),
    pytest.param(["--lora-r", "4", "--set", "sft.gradient_checkpointing=true"], id="lora-checkpointing"),
])
@pytest.mark.slow(30)
def test_sharded_sft_in_two_processes_matches_one_unsharded_process(tiny_model_dir, demos, tmp_path, variant):
    """8 demonstrations, 4 a step in one process, 2 a step in each of two sharded ones, two steps: the same losses
    and gradient norms each step, the same weights at the end (LoRA merged), and each process's slices in the
    trainer's checkpoints."""
    run([*ONE, *sft_command(tiny_model_dir, demos, "--batch-size", "4", *variant), "--out", str(tmp_path / "one")],
        ROOT)
    run([*LAUNCH, *sft_command(tiny_model_dir, demos, "--batch-size", "2", *variant, "--set",
                                "sft.sharding=fsdp"), "--out", str(tmp_path / "two")], ROOT)
    logged = [[s for s in metrics(tmp_path / name) if "loss/sft" in s] for name in ("one", "two")]
    assert [s["step"] for s in logged[0]] == [s["step"] for s in logged[1]] == [1, 2]
    for single, double in zip(*logged, strict=True):
        assert double["loss/sft"] == pytest.approx(single["loss/sft"], rel=1e-5)
        assert double["optim/grad_norm"] == pytest.approx(single["optim/grad_norm"], rel=1e-4)
    moved, apart = update_gap(tiny_model_dir, tmp_path / "one" / "final", tmp_path / "two" / "final")
    assert moved > 1e-4 and apart < 1e-4, (moved, apart)
    slices = sorted(p.name for p in (tmp_path / "two" / "checkpoint-2" / "sharded").glob("*.distcp"))
    assert slices == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow(57)
def test_sharded_sft_resumed_from_its_checkpoint_ends_as_one_left_alone(tiny_model_dir, demos, tmp_path):
    """Two sharded processes: a run of 2 steps, and a run stopped after 1 step then resumed to 2 from its
    checkpoint's slices: the same second step and the same final weights."""
    common = [*LAUNCH, *sft_command(tiny_model_dir, demos, "--batch-size", "2", "--set", "sft.sharding=fsdp",
                                    "--set", "sft.save_steps=1")]
    run([*common, "--max-steps", "2", "--out", str(tmp_path / "alone")], ROOT)
    run([*common, "--max-steps", "1", "--out", str(tmp_path / "resumed")], ROOT)
    run([*common, "--max-steps", "2", "--resume", "--out", str(tmp_path / "resumed")], ROOT)
    alone, resumed = ([s for s in metrics(tmp_path / name) if "loss/sft" in s] for name in ("alone", "resumed"))
    assert [s["step"] for s in resumed] == [1, 2]
    assert resumed[1]["loss/sft"] == pytest.approx(alone[1]["loss/sft"], rel=1e-6)
    for mine, theirs in zip(load_model(tmp_path / "resumed" / "final").parameters(),
                            load_model(tmp_path / "alone" / "final").parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_sharded_sft_in_one_process_is_refused(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path):
    from trajlab.data.datasets import sft_dataset

    from .test_sft import demonstrations

    dataset = sft_dataset(demonstrations(tiny_tokenizer, tiny_template, n=2), include_failures=False,
                          shortest_per_task=False)
    with pytest.raises(UserError, match=r"sft.sharding: fsdp shards the model over the trainer processes"):
        trajlab.sft(tiny_model_dir, dataset, tmp_path, tokenizer=tiny_tokenizer, sharding="fsdp", max_steps=1)
