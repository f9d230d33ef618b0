"""Asynchronous RL (``rl.max_staleness``) on the tiny model: versions, staleness, overlap and the correction."""

from __future__ import annotations

import json

import pytest

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.models.loading import load_model, load_tokenizer

from ..rollout.length_env import SLOW
from ..rollout.length_env import SPEC as LENGTH

ROLLOUT = RolloutSettings(max_turns=1, max_new_tokens=48, concurrency=8)


def settings(**changes) -> RLSettings:
    return RLSettings(tasks_per_step=2, group_size=4, learning_rate=1e-3, temperature=1.0, rewards={"env": 1.0},
                      **changes)


def rl(model_dir, out, env=LENGTH, resume=False, **changes) -> list[dict]:
    tokenizer = load_tokenizer(model_dir)
    trajlab.rl(model_dir, env, out, tokenizer=tokenizer, rollout=ROLLOUT, device="cpu", resume=resume,
               **settings(**changes).model_dump())
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_no_staleness_is_the_synchronous_loop(terse_model_dir, tmp_path):
    """max_staleness 0 through the rollout thread: every step is sampled by the weights just trained. The sampler's
    logprobs equal the trainer's up to rounding (the hf backend samples from the trained model itself; one update
    behind, they differ by 0.2-0.3 on average, see the next test); and the run equals one stopped after step 1 and
    resumed from its checkpoint, which cannot have sampled step 2 from anything but step 1's weights."""
    through = rl(terse_model_dir, tmp_path / "through", steps=2)
    rl(terse_model_dir, tmp_path / "resumed", steps=1)
    resumed = rl(terse_model_dir, tmp_path / "resumed", steps=2, resume=True)
    assert [s["step"] for s in resumed] == [1, 2]
    for a, b in zip(through, resumed, strict=True):
        assert a["mismatch/abs_logprob"] < 1e-5 and a["rollout/staleness/0"] == 8 and a["rollout/dropped_stale"] == 0
        assert a["reward/mean"] == b["reward/mean"] and a["optim/trained_sequences"] == b["optim/trained_sequences"]
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-4)
    assert through[1]["optim/trained_sequences"] > 0, "a real update before the compared step"
    first, second = (load_model(tmp_path / name / "final").state_dict() for name in ("through", "resumed"))
    # a checkpoint's reload changes the next gradient by rounding only (grad_norm agrees to 1e-5 relative), which
    # Adam turns into moves far below its learning rate
    assert max((first[name] - second[name]).abs().max().item() for name in first) < 0.05 * 1e-3


def test_one_step_of_staleness_overlaps_and_corrects(terse_model_dir, tmp_path):
    """With max_staleness 1 the next step's rollouts run during the update (a verifier that takes 0.4 s per
    episode), each step after the first trains on rollouts one version old, and importance sampling (on under auto)
    sees a sampler that is no longer the trainer."""
    steps = rl(terse_model_dir, tmp_path / "async", env=SLOW, steps=3, max_staleness=1)
    assert steps[0]["rollout/staleness/0"] == 8 and "rollout/staleness/1" not in steps[0]
    assert [s.get("rollout/staleness/1") for s in steps[1:]] == [8, 8]
    assert all(s["rollout/dropped_stale"] == 0 for s in steps)
    assert steps[0]["perf/overlap_s"] > 0, "the rollouts of step 2 ran while step 1 trained"
    assert steps[0]["mismatch/abs_logprob"] < 1e-4, "step 1 was sampled by the weights it trains"
    assert steps[1]["mismatch/abs_logprob"] > 10 * max(steps[0]["mismatch/abs_logprob"], 1e-6), "one update behind"
    assert steps[2]["optim/trained_sequences"] > 0
