"""Sharded RL (``rl.sharding: fsdp``) with the ``vllm`` backend: two trainer processes, each with its own in-process
engine, which gets the trained weights gathered a layer at a time after every update (the vLLM lane only)."""

from __future__ import annotations

import json

import pytest

from ..train.test_multiprocess import LAUNCH, ROOT, run

pytest.importorskip("vllm", reason="the vLLM lane: `scripts/test.sh --vllm` runs tests/vllm in .venv-vllm")


def test_each_processs_engine_samples_from_the_weights_the_sharded_update_left(terse_model_dir, tmp_path):
    """Five steps at a large rate (1e-2): after every step that trained, the next step's rollouts are scored by the
    trainer within rounding of what the engines reported (a stale engine would be off by the update, orders of
    magnitude more). All four rollouts of a group sample: the terse model's greedy answer (the default recipe's
    greedy member) scores 0 here like the samples cut at 48 tokens, leaving too few groups with a signal."""
    run([*LAUNCH, "rl", "--model", str(terse_model_dir), "--env", "tests.rollout.length_env:SPEC", "--steps", "5",
         "--tasks-per-step", "3", "--group-size", "4", "--learning-rate", "1e-2", "--device", "cpu", "--backend",
         "vllm", "--set", "rollout.max_turns=1", "--set", "rollout.max_new_tokens=48", "--set",
         "rollout.concurrency=8", "--set", "rl.temperature=1.0", "--set", "rl.rewards={env: 1.0}", "--set",
         "rl.sharding=fsdp", "--set", "rl.greedy_rollout=false", "--out", str(tmp_path)], ROOT)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["perf/processes"] for s in steps] == [2] * 5
    after_training = [later for earlier, later in zip(steps, steps[1:], strict=False)
                      if earlier["optim/trained_sequences"] and "mismatch/abs_logprob" in later]
    assert after_training, "some step trained and the next one was measured"
    for step in after_training:
        assert step["mismatch/abs_logprob"] < 1e-5, step["step"]
