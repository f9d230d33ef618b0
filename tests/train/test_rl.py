"""The RL loop on the real tiny model: a short run that logs every metric and resumes, the rate schedule, LoRA with a
KL term, activation checkpointing, another sampler corrected for, the drift guard."""

import json

import pytest
import torch

import trajlab
from trajlab.config import LoraSettings, RLSettings, RolloutSettings
from trajlab.config.sections import REPLAY_PER_STEP
from trajlab.data.store import read_trajectories
from trajlab.env import load_env
from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.train.schedule import failed_share, learning_rate_factor

from ..rollout.length_env import SUCCEEDING


def tiny_settings(**overrides):
    # the rate these tests check held, whatever the rollouts' outcomes (the defaults warm up and follow failures)
    rl = dict(steps=2, tasks_per_step=2, group_size=2, minibatch_size=4, save_steps=1, learning_rate=1e-4,
              warmup_steps=0, rate_by_failures=False)
    return RLSettings(**(rl | overrides)), RolloutSettings(max_turns=2, max_new_tokens=8, concurrency=8)

def test_short_run_logs_every_metric_and_resumes(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    env = load_env("arithmetic")
    rewards = {"env": 1.0, "progress": 0.5, "format": 0.0}
    settings, rollout = tiny_settings(steps=1, rewards=rewards, kl_coef=0.01)
    trajlab.rl(tiny_model_dir, env, tmp_path, tokenizer=tokenizer, rollout=rollout, **settings.model_dump())
    settings, rollout = tiny_settings(steps=2, rewards=rewards, kl_coef=0.01)
    final = trajlab.rl(tiny_model_dir, env, tmp_path, tokenizer=tokenizer, rollout=rollout, resume=True,
                       **settings.model_dump())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2], "the resumed run continues at step 2"
    for key in ("reward/mean", "reward/env", "reward/progress", "reward/format", "rollout/success_rate",
                "rollout/tool_error_rate", "rollout/parse_error_rate", "rollout/zero_variance_groups", "loss/kl",
                "loss/entropy", "perf/tokens_per_s"):
        assert key in records[-1]
    assert json.loads((tmp_path / "checkpoint" / "trajlab_state.json").read_text()) == {"step": 2}
    rollouts = list(read_trajectories(tmp_path / "rollouts.jsonl"))  # what each step trained on, for the report
    assert len(rollouts) == len({t.id for t in rollouts}) == 2 * 2 * 2, "both steps' rollouts, each once"
    assert sorted({t.metrics["rl/step"] for t in rollouts}) == [1.0, 2.0]
    for trajectory in rollouts:
        turns = sum(1 for i, bit in enumerate(trajectory.tokens.loss_mask) if bit and not (
            i and trajectory.tokens.loss_mask[i - 1]))
        assert [k for k in trajectory.metrics if k.startswith("advantage/")] == [f"advantage/{n}" for n in range(turns)]
        assert trajectory.metrics["rl/trained"] in (0.0, 1.0) and "rl/reward" in trajectory.metrics
        tokens = trajectory.tokens
        # with a KL term every trained rollout goes through the loss, so the update has its trainer logprobs
        assert (tokens.trainer_logprobs is not None) == bool(trajectory.metrics["rl/trained"])
        if tokens.trainer_logprobs is not None:  # on-policy hf: the trainer's logprob is the sampler's
            for sampled, trained, bit in zip(tokens.logprobs, tokens.trainer_logprobs, tokens.loss_mask, strict=True):
                assert (trained is None) == (not bit) and (not bit or abs(trained - sampled) < 1e-4)
    assert any(t.tokens.trainer_logprobs for t in rollouts)
    assert sum(p.numel() for p in load_model(final).parameters()) > 1_000_000

@pytest.mark.parametrize(("shape", "factors"), [("cosine", [1.0, 0.75, 0.25]), ("linear", [1.0, 2 / 3, 1 / 3])])
def test_a_decaying_rate_falls_toward_zero_at_the_last_step(tiny_model_dir, tmp_path, shape, factors):
    """One optimizer step per RL step (4 rollouts, minibatches of 4; the KL term trains every rollout): the rate
    each step used follows the schedule over the run's 3 steps, and never 0, so no step is wasted."""
    tokenizer = load_tokenizer(tiny_model_dir)
    settings, rollout = tiny_settings(steps=3, kl_coef=0.01, lr_scheduler=shape)
    trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path, tokenizer=tokenizer, rollout=rollout,
               **settings.model_dump())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["optim/lr"] for r in records] == pytest.approx([1e-4 * f for f in factors])
    assert [learning_rate_factor(done, settings) for done in (3, 9)] == [0.0, 0.0], "and 0 past the plan"

def test_lora_with_kl_to_the_starting_policy(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    settings, rollout = tiny_settings(steps=1, kl_coef=0.1, lora=LoraSettings(r=4, alpha=8))
    final = trajlab.rl(tiny_model_dir, load_env("guess"), tmp_path, tokenizer=tokenizer, rollout=rollout,
                       **settings.model_dump())
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["loss/kl"] >= 0.0
    merged = load_model(final)
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_a_step_runs_with_gradient_checkpointing(tiny_model_dir, tiny_tokenizer, tmp_path):
    model = load_model(tiny_model_dir)  # the whole loop: rollouts with the cache, the update checkpointed
    settings, rollout = tiny_settings(steps=1, gradient_checkpointing=True)
    trajlab.rl(model, load_env("arithmetic"), tmp_path, tokenizer=tiny_tokenizer, rollout=rollout,
               **settings.model_dump())
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) and record["perf/update_s"] > 0


def test_a_sampler_other_than_the_trainer_is_corrected_by_default(tiny_model_dir, other_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    settings, rollout = tiny_settings(steps=1, kl_coef=0.01, importance_cap=1.2)  # KL: every rollout is trained on
    records = {}
    for name, mode, sampler in (("stale", "auto", HFGenerator(load_model(other_model_dir), tokenizer,
                                                              max_batch_size=32)),
                                ("own", "auto", None), ("off", "off", HFGenerator(load_model(other_model_dir),
                                                                                  tokenizer, max_batch_size=32))):
        out = tmp_path / name
        trajlab.rl(tiny_model_dir, load_env("arithmetic"), out, tokenizer=tokenizer, rollout=rollout, sampler=sampler,
                   **settings.model_copy(update={"importance_sampling": mode}).model_dump())
        records[name] = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert records["own"]["mismatch/abs_logprob"] < 1e-3, "the hf backend samples from the trained model itself"
    assert records["stale"]["mismatch/abs_logprob"] > 0.1 and records["stale"]["mismatch/clipped_share"] > 0
    assert records["off"]["mismatch/abs_logprob"] > 0.1  # measured, not corrected
    with pytest.raises(ValueError, match="importance_sampling"):
        RLSettings(importance_sampling="sometimes")

def test_the_drift_guard_stops_a_run_or_drops_what_drifted(tiny_model_dir, tmp_path, monkeypatch):
    """The guard sees a template whose prompt ends in one more token than the rollouts' (as when training under
    another template than the one rolled out with): every trajectory drifts."""
    from trajlab.chat.template import ChatTemplate
    from trajlab.rollout import drift

    def shifted(self, messages):
        return ChatTemplate.prompt_ids(self, messages) + self.encode("\n")

    tokenizer = load_tokenizer(tiny_model_dir)
    settings, rollout = tiny_settings(steps=1, kl_coef=0.01)
    trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path / "clean", tokenizer=tokenizer, rollout=rollout,
               **settings.model_dump())
    record = json.loads((tmp_path / "clean" / "metrics.jsonl").read_text())
    assert record["rollout/drifted"] == 0 and record["optim/trained_sequences"] == 4
    assert record["perf/drift_check_s"] > 0

    monkeypatch.setattr(drift._PrefixRenders, "prompt_ids", shifted)  # the guard's view of the template only
    with pytest.raises(drift.TokenDriftError, match=r"4 of 4 trajectories .* the prompt"):
        trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path / "stops", tokenizer=tokenizer, rollout=rollout,
                   **settings.model_dump())
    tolerant = settings.model_copy(update={"max_drift": 1.0})
    trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path / "drops", tokenizer=tokenizer, rollout=rollout,
               **tolerant.model_dump())
    record = json.loads((tmp_path / "drops" / "metrics.jsonl").read_text())
    assert record["rollout/drifted"] == 4 and record["optim/trained_sequences"] == 0, "drifted rollouts are not trained"


def test_a_template_that_rewrites_history_trains_one_sample_per_turn(tiny_model_dir, tmp_path):
    """The tiny template edited to mark the latest user message (as Mistral's moves its tool list there): earlier
    turns render differently once a user speaks again, so rollouts are kept and trained one sample per turn."""
    tokenizer = load_tokenizer(tiny_model_dir)
    line = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    assert line in tokenizer.chat_template
    tokenizer.chat_template = (
        "{%- set ns = namespace(last=none) -%}{%- for m in messages if m.role == 'user' -%}"
        "{%- set ns.last = m -%}{%- endfor -%}" + tokenizer.chat_template.replace(line, line.replace(
            "message.content + '<|im_end|>", "message.content + (' (latest)' if message is sameas ns.last else '') "
            "+ '<|im_end|>")))
    settings, rollout = tiny_settings(steps=1, kl_coef=0.01)
    trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path, tokenizer=tokenizer, rollout=rollout,
               **settings.model_dump())
    rollouts = list(read_trajectories(tmp_path / "rollouts.jsonl"))
    assert len(rollouts) == 4 and all(t.tokens is None and t.branches for t in rollouts)
    for trajectory in rollouts:
        assert len(trajectory.branches) == trajectory.metrics["turns"]
        prompt = tokenizer.decode(trajectory.branches[0].prompt_ids)
        assert prompt.endswith(" (latest)<|im_end|>\n<|im_start|>assistant\n")
        assert all(lp is not None for branch in trajectory.branches for lp in branch.logprobs)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["rollout/drifted"] == 0
    assert record["optim/trained_sequences"] == sum(len(t.branches) for t in rollouts)

def test_rate_by_failures_scales_each_steps_rate_by_its_failed_share(tiny_model_dir, tmp_path):
    """The step's logged rate is the schedule's times the share of its rollouts that did not succeed (the untrained
    model fails them all here, so the share is 1: the scaling itself is tested in tests/train/test_update.py)."""
    settings, rollout = tiny_settings(steps=2, rate_by_failures=True)
    trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path, tokenizer=load_tokenizer(tiny_model_dir),
               rollout=rollout, **settings.model_dump())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rollouts = list(read_trajectories(tmp_path / "rollouts.jsonl"))
    for done, record in enumerate(records):
        step = [t for t in rollouts if t.metrics["rl/step"] == record["step"]]
        share = failed_share(step)
        assert record["optim/lr"] == pytest.approx(1e-4 * learning_rate_factor(done, settings) * share)
    assert failed_share([]) == 1.0


@pytest.mark.parametrize("rate_by_failures", [True, False])
def test_a_step_whose_rollouts_all_succeed_while_rewards_differ_warns_that_rate_by_failures_drops_it(
        terse_model_dir, tmp_path, caplog, rate_by_failures):
    """Every answer succeeds and rewards still differ within the groups: under ``rate_by_failures`` the step trains at
    rate 0 and the run says once what is thrown away and how to keep it; without it the step trains."""
    settings, _ = tiny_settings(steps=2, group_size=4, rate_by_failures=rate_by_failures)
    rollout = RolloutSettings(max_turns=1, max_new_tokens=48, concurrency=8)  # the terse model's answers end
    with caplog.at_level("WARNING", logger="trajlab.train.rl"):
        trajlab.rl(terse_model_dir, SUCCEEDING, tmp_path, tokenizer=load_tokenizer(terse_model_dir), rollout=rollout,
                   **settings.model_dump())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/success_rate"] == 1.0 and r["rollout/zero_variance_groups"] < 1 for r in records), records
    warnings = [r.getMessage() for r in caplog.records if "rl.rate_by_failures" in r.getMessage()]
    if rate_by_failures:
        assert [r["optim/lr"] for r in records] == [0.0, 0.0]
        assert len(warnings) == 1 and "Set rl.rate_by_failures: false" in warnings[0], "once a run"
    else:
        assert all(r["optim/lr"] > 0 for r in records) and not warnings


def test_the_defaults_that_follow_other_settings_and_one_given_stays():
    """The default recipe replays demonstrations where a file of them is given (none to replay elsewhere) and rolls
    one member of each group out greedily where it samples at temperature 1 (the ratio needs those logprobs)."""
    assert RLSettings().resolved().replay_demonstrations == 0
    assert RLSettings(demonstrations="demos.jsonl").resolved().replay_demonstrations == REPLAY_PER_STEP == 64
    assert RLSettings(demonstrations="demos.jsonl", replay_demonstrations=0).resolved().replay_demonstrations == 0
    assert RLSettings(replay_demonstrations=3).resolved().replay_demonstrations == 3  # refused later: no file
    assert RLSettings().resolved().greedy_rollout is True
    assert RLSettings(temperature=0.7).resolved().greedy_rollout is False
    assert RLSettings(greedy_rollout=False).resolved().greedy_rollout is False


def test_greedy_rollout_decodes_one_member_of_each_group_greedily(tiny_model_dir, tmp_path, caplog):
    """With ``greedy_rollout`` the first rollout of each group takes the untrained model's most likely token at every
    model position (teacher-forced again here), the others sample at temperature 1 (the untrained model's flat
    distribution then picks other tokens), and the step logs the greedy members' success."""
    settings, rollout = tiny_settings(steps=1, group_size=3, greedy_rollout=True)
    with caplog.at_level("INFO", logger="trajlab.recipes.rl"):
        trajlab.rl(tiny_model_dir, load_env("arithmetic"), tmp_path, tokenizer=load_tokenizer(tiny_model_dir),
                   rollout=rollout, **settings.model_dump())
    assert "No rl.demonstrations, so none replayed" in caplog.text, "the default replay says why it is off"
    model, rollouts = load_model(tiny_model_dir).eval(), list(read_trajectories(tmp_path / "rollouts.jsonl"))
    assert sorted(t.id.rsplit(":", 1)[1] for t in rollouts if t.metrics.get("greedy")) == ["0", "0"]

    def argmax_share(trajectory):
        tokens = trajectory.tokens
        ids = torch.tensor([tokens.prompt_ids + tokens.completion_ids])
        with torch.no_grad():
            best = model(ids).logits[0, len(tokens.prompt_ids) - 1 : -1].argmax(-1).tolist()
        chosen = [(b, c) for b, c, bit in zip(best, tokens.completion_ids, tokens.loss_mask, strict=True) if bit]
        return sum(b == c for b, c in chosen) / len(chosen)

    for trajectory in rollouts:
        share = argmax_share(trajectory)
        assert share == 1.0 if trajectory.metrics.get("greedy") else share < 0.5, (trajectory.id, share)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    greedy = [t for t in rollouts if t.metrics.get("greedy")]
    assert record["rollout/greedy_success_rate"] == sum(t.status == "success" for t in greedy) / len(greedy)
    with pytest.raises(ValueError, match="rl.greedy_rollout needs rl.temperature 1"):
        RLSettings(greedy_rollout=True, temperature=0.7)
