"""The RL trainer on the real tiny model: loss direction, masking, a short run, resume, LoRA + KL."""

import asyncio
import json

import pytest
import torch
from accelerate import Accelerator

import trajlab
from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat_template
from trajlab.config import LoraSettings, RLSettings, RolloutSettings
from trajlab.data.store import read_trajectories
from trajlab.env import load_env
from trajlab.env.mixture import load_envs
from trajlab.inference.hf import HFGenerator
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.models.tiny import init_tiny_model
from trajlab.rollout.engine import make_engine
from trajlab.rollout.types import TokenRecord, Trajectory, task_id
from trajlab.train import logprobs as logprob_math
from trajlab.train.advantages import step_advantages
from trajlab.train.batches import padded_batch
from trajlab.train.logprobs import token_logprobs
from trajlab.train.loss import loss_normaliser, policy_loss
from trajlab.train.rl import group_episodes
from trajlab.train.schedule import learning_rate_factor
from trajlab.train.update import PolicyUpdate


def trajectory_with_model_logprobs(model, tokenizer, loss_mask):
    prompt = tokenizer.encode("<|im_start|>user\nCompute (1 + 2) * 3.<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
    completion = tokenizer.encode("<tool_call>\n{\"name\": \"add\"", add_special_tokens=False)[: len(loss_mask)]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, :-1]
    full = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt + completion)[1:, None]).squeeze(-1)
    logprobs = [full[len(prompt) - 1 + i].item() if bit else None for i, bit in enumerate(loss_mask)]
    tokens = TokenRecord(prompt_ids=prompt, completion_ids=completion, loss_mask=loss_mask, logprobs=logprobs)
    return Trajectory(id="t", env="arithmetic", task={}, messages=[], tools=[], reward=1.0, status="success",
                      tokens=tokens)


def masked_logprob(model, batch):
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (lp * batch["loss_mask"][:, 1:]).sum().item()


def test_groups_are_the_steps_tasks_even_when_two_envs_repeat_a_task_id_and_ids_are_never_parsed(tiny_model_dir):
    mixture = load_envs("arithmetic,guess")
    tokenizer = load_tokenizer(tiny_model_dir)
    template = resolve_chat_template(tokenizer)
    step_tasks = [{**task, "task_id": "0"} for _, task in zip(range(2), mixture.iter_tasks("train", seed=0),
                                                              strict=False)]
    assert [task["env"] for task in step_tasks] == ["arithmetic", "guess"]
    episodes = [e for i, task in enumerate(step_tasks) for e in group_episodes(3, i, task, group_size=2)]
    engine = make_engine(mixture, ScriptedGenerator(mixture.oracle, tokenizer, template), tokenizer,
                         chat_template=template, parser=get_parser("auto", tokenizer), seed=0)
    trajectories = sorted(asyncio.run(engine.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0)),
                          key=lambda t: t.id)  # the engine returns them as done
    assert [(t.env, task_id(t.task), t.group) for t in trajectories] == [
        ("arithmetic", "0", "rl:3:0"), ("arithmetic", "0", "rl:3:0"), ("guess", "0", "rl:3:1"), ("guess", "0", "rl:3:1")
    ]
    rewards = [1.0, 0.0, 1.0, 1.0]  # arithmetic's group has signal, guess's is flat
    settings = RLSettings(estimator="dr_grpo", credit="trajectory")

    def per_rollout(ts):
        advantages, stats = step_advantages(ts, rewards, settings)
        values = [{a for a, bit in zip(adv, t.tokens.loss_mask, strict=True) if bit} for adv, t in zip(advantages, ts,
                                                                                                        strict=True)]
        return values, stats["zero_variance_groups"]

    # One group of four (by task id) would give 0.25, -0.75, 0.25, 0.25 and no flat group.
    assert per_rollout(trajectories) == ([{0.5}, {-0.5}, {0.0}, {0.0}], 0.5)
    # Ids in any format, even ones whose prefixes would all say "one group": grouping follows Trajectory.group only.
    renamed = [t.model_copy(update={"id": f"same:{n}"}) for n, t in enumerate(trajectories)]
    assert per_rollout(renamed) == ([{0.5}, {-0.5}, {0.0}, {0.0}], 0.5)
    with pytest.raises(ValueError, match="has no group"):
        step_advantages([t.model_copy(update={"group": None}) for t in trajectories], rewards, settings)


def test_an_episode_the_machinery_broke_is_no_zero_reward_in_its_group(tiny_model_dir):
    """A rollout with status error gets no advantage and is left out of its group's statistics; a group with fewer
    than two valid rollouts is skipped, not compared."""
    env = load_env("arithmetic")
    tokenizer = load_tokenizer(tiny_model_dir)
    template = resolve_chat_template(tokenizer)
    tasks = [task for _, task in zip(range(2), env.iter_tasks("train", seed=0), strict=False)]
    episodes = [e for i, task in enumerate(tasks) for e in group_episodes(0, i, task, group_size=3)]
    engine = make_engine(env, ScriptedGenerator(env.oracle, tokenizer, template), tokenizer, chat_template=template,
                         parser=get_parser("auto", tokenizer), seed=0)
    done = sorted(asyncio.run(engine.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0)), key=lambda t: t.id)
    broken = {0, 3, 4}  # one of the first group's three, two of the second's
    trajectories = [t.model_copy(update={"status": "error", "error": "the generator failed"}) if i in broken else t
                    for i, t in enumerate(done)]
    rewards = [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # as a zero, the error would pull its group's baseline down
    advantages, stats = step_advantages(trajectories, rewards, RLSettings(estimator="dr_grpo", group_size=3,
                                                                         credit="trajectory"))
    model_values = [{a for a, bit in zip(adv, t.tokens.loss_mask, strict=True) if bit}
                    for adv, t in zip(advantages, trajectories, strict=True)]
    assert model_values == [{0.0}, {0.5}, {-0.5}, {0.0}, {0.0}, {0.0}]
    assert stats == {"zero_variance_groups": 0.0, "groups_short": 2.0, "groups_skipped": 1.0}


def test_update_follows_the_advantage_on_model_tokens_only(tiny_model_dir, tiny_tokenizer):
    settings = RLSettings()
    mask = [1, 1, 1, 0, 0, 1, 1]
    for sign in (1.0, -1.0):
        model = load_model(tiny_model_dir)
        trajectory = trajectory_with_model_logprobs(model, tiny_tokenizer, mask)
        batch = padded_batch([trajectory], [[sign * bit for bit in mask]], tiny_tokenizer.pad_token_id,
                             torch.device("cpu"))
        before = masked_logprob(model, batch)
        model.train()
        stats = policy_loss(model, None, batch, settings, normaliser=1.0)
        assert abs(stats["clip_fraction"]) < 1e-6, "rollout logprobs equal the policy's: ratio is 1"
        stats["loss_tensor"].backward()
        torch.optim.SGD(model.parameters(), lr=0.05).step()
        after = masked_logprob(model, batch)
        assert (after - before) * sign > 0

    # Advantages on observation tokens (loss_mask 0) must not change the gradient.
    model = load_model(tiny_model_dir)
    trajectory = trajectory_with_model_logprobs(model, tiny_tokenizer, mask)
    grads = []
    for noise in (0.0, 5.0):
        advantages = [1.0 if bit else noise for bit in mask]
        batch = padded_batch([trajectory], [advantages], tiny_tokenizer.pad_token_id, torch.device("cpu"))
        model.zero_grad()
        policy_loss(model, None, batch, settings, normaliser=1.0)["loss_tensor"].backward()
        grads.append(model.model.embed_tokens.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1])


def test_padding_is_marked_by_attention_mask_even_when_pad_is_a_real_token(tiny_model_dir, tiny_tokenizer):
    model = load_model(tiny_model_dir)
    short = trajectory_with_model_logprobs(model, tiny_tokenizer, [1, 1])
    long = trajectory_with_model_logprobs(model, tiny_tokenizer, [1, 1, 1, 1, 1])
    pad = short.tokens.completion_ids[-1]  # pad id equal to a token the model generated
    batch = padded_batch([short, long], [[1.0, 1.0], [1.0] * 5], pad, torch.device("cpu"))
    lengths = [len(t.tokens.prompt_ids) + len(t.tokens.completion_ids) for t in (short, long)]
    assert batch["attention_mask"].sum(-1).tolist() == lengths
    assert batch["loss_mask"].sum(-1).tolist() == [2, 5]


def test_micro_batches_accumulate_to_the_gradient_of_one_batch(tiny_model_dir, tiny_tokenizer):
    """Micro-batches differ in width and in where completions start; their summed gradients must not."""
    model = load_model(tiny_model_dir)
    masks = [[1, 1], [1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1], [1, 0, 1]]
    trajectories = [trajectory_with_model_logprobs(model, tiny_tokenizer, mask) for mask in masks]
    trajectories[1].tokens.prompt_ids = trajectories[1].tokens.prompt_ids[3:]  # a shorter prompt
    advantages = [[(-1.0) ** i * 0.5 * bit for bit in mask] for i, mask in enumerate(masks)]
    pad = tiny_tokenizer.pad_token_id
    for estimator in ("grpo", "dr_grpo", "rloo"):
        settings = RLSettings(estimator=estimator)
        normaliser = loss_normaliser(trajectories, estimator, token_budget=16)
        grads = []
        for size in (4, 1):
            model.zero_grad()
            for first in range(0, 4, size):
                batch = padded_batch(trajectories[first : first + size], advantages[first : first + size], pad,
                              torch.device("cpu"))
                policy_loss(model, None, batch, settings, normaliser)["loss_tensor"].backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert grads[0].abs().sum() > 0
        assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4), estimator


def test_rollouts_without_advantage_are_skipped_and_the_step_is_unchanged(tiny_model_dir, tiny_tokenizer):
    masks = [[1, 1, 1], [1, 1, 1, 1], [1, 1]]
    advantages = [[0.5] * 3, [0.0] * 4, [-0.5] * 2]  # the middle rollout's group had no signal
    settings = RLSettings(estimator="grpo", max_grad_norm=1e6)
    pad = tiny_tokenizer.pad_token_id
    weights, stats = [], {}
    for skipping in (True, False):
        model = load_model(tiny_model_dir).train()
        trajectories = [trajectory_with_model_logprobs(model, tiny_tokenizer, mask) for mask in masks]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if skipping:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
            update = PolicyUpdate(model, None, optimizer, scheduler, Accelerator(cpu=True), settings, 16, pad)
            stats, _ = update(trajectories, advantages, correct=False, shuffle_seed=0)
        else:  # every rollout through the loss, as one batch
            batch = padded_batch(trajectories, advantages, pad, torch.device("cpu"))
            normaliser = loss_normaliser(trajectories, "grpo", 16)
            policy_loss(model, None, batch, settings, normaliser)["loss_tensor"].backward()
            optimizer.step()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert stats["trained_sequences"] == 2
    assert not torch.equal(weights[0], torch.cat([p.flatten() for p in load_model(tiny_model_dir).parameters()]))
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


def test_a_shared_prompt_head_runs_once_with_the_same_logprobs_and_gradients(tiny_model_dir, tiny_tokenizer,
                                                                             monkeypatch):
    system = "<|im_start|>system\nYou solve arithmetic with the calculator tools, one call at a time.<|im_end|>\n"
    questions = ["Compute (1 + 2) * 3.", "Compute (1 + 2) * 3.", "Compute (9 - 4) + 6."]
    completions = ["<tool_call>\n{\"name\": \"add\"", "<tool_call>\n{\"name\": \"multiply\", \"arguments\"", "Hi"]
    model = load_model(tiny_model_dir).train()
    trajectories = []
    for question, completion in zip(questions, completions, strict=True):
        prompt = tiny_tokenizer.encode(f"{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
        ids = tiny_tokenizer.encode(completion, add_special_tokens=False)
        tokens = TokenRecord(prompt_ids=prompt, completion_ids=ids, loss_mask=[1] * len(ids),
                             logprobs=[-1.0] * len(ids))
        trajectories.append(Trajectory(id="t", env="arithmetic", task={}, messages=[], tools=[], reward=1.0,
                                       status="success", tokens=tokens))
    batch = padded_batch(trajectories, [[0.5] * len(t.tokens.completion_ids) for t in trajectories],
                  tiny_tokenizer.pad_token_id, torch.device("cpu"))
    assert logprob_math.shared_head(batch["input_ids"], batch["completion_start"]) >= logprob_math.MIN_SHARED_HEAD

    results = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(logprob_math, "MIN_SHARED_HEAD", 10**9)
        model.zero_grad()
        logprobs, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_start"],
                                      1.0)
        policy_loss(model, None, batch, RLSettings(), normaliser=3.0)["loss_tensor"].backward()
        results.append((logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (shared_lp, shared_grad), (full_lp, full_grad) = results
    mask = batch["attention_mask"][:, batch["completion_start"] :].bool()  # predicting padding means nothing
    assert torch.allclose(shared_lp[mask], full_lp[mask], atol=1e-5)
    assert full_grad.abs().sum() > 0 and torch.allclose(shared_grad, full_grad, atol=1e-6, rtol=1e-4)


def tiny_settings(**overrides):
    rl = dict(steps=2, tasks_per_step=2, group_size=2, minibatch_size=4, save_steps=1, learning_rate=1e-4)
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


def test_gradient_checkpointing_gives_the_same_loss_and_gradients_and_runs_a_step(tiny_model_dir, tiny_tokenizer,
                                                                                 tmp_path):
    trajectories = [trajectory_with_model_logprobs(load_model(tiny_model_dir), tiny_tokenizer, [1] * n) for n in (4, 6)]
    batch = padded_batch(trajectories, [[0.5] * 4, [-0.5] * 6], tiny_tokenizer.pad_token_id, torch.device("cpu"))
    results = []
    for checkpointing in (False, True):
        model = load_model(tiny_model_dir).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = policy_loss(model, None, batch, RLSettings(), normaliser=2.0)["loss_tensor"]
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (loss, grad), (checkpointed_loss, checkpointed_grad) = results
    assert checkpointed_loss == pytest.approx(loss, abs=1e-6)
    assert grad.abs().sum() > 0 and torch.allclose(checkpointed_grad, grad, atol=1e-6, rtol=1e-4)

    model = load_model(tiny_model_dir)  # the whole loop: rollouts with the cache, the update checkpointed
    settings, rollout = tiny_settings(steps=1, gradient_checkpointing=True)
    trajlab.rl(model, load_env("arithmetic"), tmp_path, tokenizer=tiny_tokenizer, rollout=rollout,
               **settings.model_dump())
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) and record["perf/update_s"] > 0


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """A second tiny model (other weights, same tokenizer): a sampler that is not the trainer."""
    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed1", seed=1)


def sampled_by(sampler, trainer, tokenizer, masks):
    """Trajectories whose logprobs are ``sampler``'s, to be trained on by ``trainer``; and the trainer's logprobs."""
    sampled = [trajectory_with_model_logprobs(sampler, tokenizer, mask) for mask in masks]
    own = [trajectory_with_model_logprobs(trainer, tokenizer, mask) for mask in masks]
    return sampled, [[lp or 0.0 for lp in t.tokens.logprobs] for t in own]


def test_off_policy_correction_weights_each_token_by_the_truncated_importance_ratio(tiny_model_dir, other_model_dir,
                                                                                     tiny_tokenizer):
    trainer, sampler = load_model(tiny_model_dir).train(), load_model(other_model_dir)
    masks = [[1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]]
    sampled, trainer_lp = sampled_by(sampler, trainer, tiny_tokenizer, masks)
    advantages = [[0.7 * bit for bit in masks[0]], [-0.4 * bit for bit in masks[1]]]
    settings = RLSettings(importance_cap=1.5)
    pad = tiny_tokenizer.pad_token_id
    batch = padded_batch(sampled, advantages, pad, torch.device("cpu"), trainer_lp)

    trainer.zero_grad()
    policy_loss(trainer, None, batch, settings, normaliser=2.0)["loss_tensor"].backward()
    corrected = torch.cat([p.grad.flatten() for p in trainer.parameters()])

    # By hand: the ratio against the trainer's own logprobs is 1 before any step, so each token's gradient is
    # -A * w * grad(log p) with w = min(p_trainer / p_sampler, cap), a sequence mean per rollout (grpo).
    trainer.zero_grad()
    start = batch["completion_start"]
    logprobs, _ = token_logprobs(trainer, batch["input_ids"], batch["attention_mask"], start, 1.0)
    mask, sampler_lp = batch["loss_mask"][:, start:], batch["old_logprobs"][:, start:]
    weight = torch.exp(batch["trainer_logprobs"][:, start:] - sampler_lp).clamp(max=1.5)
    assert ((weight < 1.5) & (mask > 0)).any() and ((weight == 1.5) & (mask > 0)).any(), "some weights capped"
    per_token = -(weight * batch["advantages"][:, start:] * logprobs)
    ((per_token * mask).sum(-1) / mask.sum(-1)).sum().div(2.0).backward()
    by_hand = torch.cat([p.grad.flatten() for p in trainer.parameters()])
    assert corrected.abs().sum() > 0 and torch.allclose(corrected, by_hand, atol=1e-6, rtol=1e-4)

    trainer.zero_grad()  # uncorrected: the sampler's logprobs as the old policy, a different gradient
    policy_loss(trainer, None, padded_batch(sampled, advantages, pad, torch.device("cpu")), settings, 2.0)[
        "loss_tensor"].backward()
    assert not torch.allclose(torch.cat([p.grad.flatten() for p in trainer.parameters()]), by_hand, atol=1e-4)


def test_update_recomputes_the_trainers_logprobs_and_logs_the_mismatch(tiny_model_dir, other_model_dir,
                                                                        tiny_tokenizer):
    masks = [[1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1], [1, 1]]
    advantages = [[0.5] * 5, [-0.5] * 6, [0.0] * 2]
    settings = RLSettings(importance_cap=1.5)
    pad = tiny_tokenizer.pad_token_id
    for sampler_dir in (other_model_dir, tiny_model_dir):
        trainer = load_model(tiny_model_dir).train()
        sampled, trainer_lp = sampled_by(load_model(sampler_dir), trainer, tiny_tokenizer, masks)
        delta = torch.tensor([t - s.tokens.logprobs[i] for s, lps in zip(sampled, trainer_lp, strict=True)
                              for i, t in enumerate(lps) if s.tokens.loss_mask[i]])
        optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        stats = {}
        for correct in (True, False):
            update = PolicyUpdate(trainer, None, optimizer, scheduler, Accelerator(cpu=True), settings, 16, pad)
            stats[correct], _ = update(sampled, advantages, correct=correct, shuffle_seed=0)
            trainer.load_state_dict(load_model(tiny_model_dir).state_dict())
        measured = stats[True]
        assert measured["mismatch/abs_logprob"] == pytest.approx(delta.abs().mean().item(), abs=1e-5)
        assert measured["mismatch/kl"] == pytest.approx((delta.exp() - delta - 1).mean().item(), abs=1e-5)
        assert measured["mismatch/clipped_share"] == pytest.approx((delta.exp() > 1.5).float().mean().item())
        if sampler_dir == tiny_model_dir:  # on-policy: nothing to correct
            assert measured["mismatch/abs_logprob"] < 1e-5 and measured["mismatch/clipped_share"] == 0.0
        else:
            assert measured["mismatch/abs_logprob"] > 0.1 and measured["mismatch/clipped_share"] > 0.0
        # Without the correction the mismatch is still measured, on the rollouts trained before the first step.
        trained = torch.tensor([bool(any(a)) for a, s in zip(advantages, sampled, strict=True)
                                for bit in s.tokens.loss_mask if bit])
        assert stats[False]["mismatch/abs_logprob"] == pytest.approx(delta[trained].abs().mean().item(), abs=1e-5)


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
