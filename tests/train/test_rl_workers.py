"""RL with rollout workers on a real local Ray cluster, against the same run in-process.

A module of its own: the rollout worker tests hold their cluster's CPUs for their whole module.
"""

from __future__ import annotations

import json
import shutil

import pytest

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.train.checkpoints import CHECKPOINT

from ..rollout.dying_env import LENGTH, arm
from ..rollout.length_env import SLOW

pytest.importorskip("ray")


@pytest.mark.slow(28)
def test_rl_with_two_workers_learns_as_in_process(terse_model_dir, tmp_path, monkeypatch):
    """Two RL steps: the workers sample what the in-process engine samples (seeded per episode and turn), take the
    trainer's weights after the first step, and the update ends at the same weights; a worker killed in the middle
    of the second step costs nothing: its episodes are run again on its replacement (which gets the trained weights),
    none is lost, none is trained twice, none reaches the update as a zero reward.

    The second step is compared with an in-process run resumed from the workers run's own checkpoint of the first
    step: two trainers' first updates differ by ~1e-5 (their samplers' logprobs by ~1e-7, which Adam magnifies where
    gradients are near its eps), enough to flip a sampled token now and then, so only the same weights can promise
    the same samples."""
    marker = tmp_path / "died"
    arm(monkeypatch, marker, task_id="train-2")  # the second step's first task (two tasks a step, in order)
    tokenizer = load_tokenizer(terse_model_dir)
    settings = RLSettings(steps=2, tasks_per_step=2, group_size=4, learning_rate=1e-3, temperature=1.0,
                          rewards={"env": 1.0}, importance_sampling="on", save_steps=1)
    # "on" in both runs: with workers (another sampler) auto would turn it on, in-process off
    first_step = tmp_path / "resumed" / CHECKPOINT

    def keep_first_step(record: dict[str, float]) -> None:  # called before the second step's checkpoint replaces it
        if record["step"] == 2:
            shutil.copytree(tmp_path / "workers" / CHECKPOINT, first_step)

    def rl(name: str, workers: int, **kwargs: object) -> list[dict[str, float]]:
        rollout = RolloutSettings(max_turns=1, max_new_tokens=48, concurrency=8, workers=workers,
                                  retry_backoff_s=0.1)
        trajlab.rl(terse_model_dir, LENGTH, tmp_path / name, tokenizer=tokenizer, rollout=rollout, device="cpu",
                   **kwargs, **settings.model_dump())
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    in_process = rl("in_process", 0)
    remote = rl("workers", 2, on_step=keep_first_step)
    resumed = rl("resumed", 0, resume=True)
    assert marker.exists(), "a worker was killed"
    assert [step["rollout/workers_replaced"] for step in remote] == [0, 1]
    assert remote[1]["rollout/retries"] >= 1 and remote[1]["rollout/errors"] == 0, "its episodes ran again"
    assert [step["step"] for step in resumed] == [2]
    for local, on_workers in ((in_process[0], remote[0]), (resumed[0], remote[1])):
        assert on_workers["reward/mean"] == local["reward/mean"]
        assert on_workers["rollout/mean_turns"] == local["rollout/mean_turns"]
        assert on_workers["optim/trained_sequences"] == local["optim/trained_sequences"] > 0, "the same trained"
        assert on_workers["rollout/episodes"] == local["rollout/episodes"] == 8, "none lost, none twice"
        assert on_workers["mismatch/abs_logprob"] < 1e-4, "the workers sampled from the trainer's weights"
    # Adam's first step moves each weight by about the learning rate whatever the gradient's scale; the two runs'
    # sampler logprobs differ by ~1e-7 (two processes), which moves weights whose gradient is near Adam's eps.
    start = load_model(terse_model_dir).state_dict()
    finals = [load_model(tmp_path / name / "final").state_dict() for name in ("workers", "resumed")]
    moved = max((w - start[n]).abs().max().item() for n, w in finals[0].items())
    apart = max((a - b).abs().max().item() for a, b in zip(finals[0].values(), finals[1].values(), strict=True))
    assert moved > 0.5 * settings.learning_rate and apart < 0.1 * settings.learning_rate, (moved, apart)


@pytest.mark.slow(23)
def test_asynchronous_rl_on_workers_samples_what_it_does_in_process(terse_model_dir, tmp_path):
    """rl.max_staleness 1 with two workers: the next step's rollouts run on the workers during the update, each
    step after the first trains on rollouts one version old, and the workers take every trained version (the same
    rewards as the in-process behaviour copy gives, step by step)."""
    tokenizer = load_tokenizer(terse_model_dir)
    settings = RLSettings(steps=3, tasks_per_step=2, group_size=4, learning_rate=1e-3, temperature=1.0,
                          rewards={"env": 1.0}, max_staleness=1)
    runs = []
    for name, workers in (("in_process", 0), ("workers", 2)):
        rollout = RolloutSettings(max_turns=1, max_new_tokens=48, concurrency=8, workers=workers)
        trajlab.rl(terse_model_dir, SLOW, tmp_path / name, tokenizer=tokenizer, rollout=rollout, device="cpu",
                   **settings.model_dump())
        runs.append([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    local, remote = runs
    assert [s.get("rollout/staleness/1") for s in remote] == [None, 8, 8]
    assert all(s["rollout/dropped_stale"] == 0 for s in remote)
    assert remote[0]["perf/overlap_s"] > 0, "the rollouts of step 2 ran on the workers while step 1 trained"
    assert remote[1]["mismatch/abs_logprob"] > 10 * max(remote[0]["mismatch/abs_logprob"], 1e-6), "one update behind"
    assert [s["reward/mean"] for s in remote] == [s["reward/mean"] for s in local], "each version's weights sampled"
    assert [s["optim/trained_sequences"] for s in remote] == [s["optim/trained_sequences"] for s in local]
