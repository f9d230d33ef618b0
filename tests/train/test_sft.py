"""SFT through TRL on real reference trajectories: loss on model tokens only, checkpoints, resume, LoRA."""

import asyncio
import itertools
import json

import pytest

import trajlab
from trajlab.chat.parsers import get_parser
from trajlab.config import LoraSettings, SFTSettings
from trajlab.data.datasets import sft_dataset
from trajlab.env import load_env
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.loading import load_model
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


def demonstrations(tokenizer, template, n=8):
    spec = load_env("arithmetic")
    engine = RolloutEngine(spec, ScriptedGenerator(spec.oracle, tokenizer, template), tokenizer,
                           chat_template=template, parser=get_parser("auto", tokenizer), seed=0)
    tasks = list(itertools.islice(spec.iter_tasks("train", seed=0), n))
    return asyncio.run(engine.run([Episode(t["task_id"], t) for t in tasks], concurrency=8, retries=0,
                                  retry_backoff_s=1.0))


def test_system_user_and_tool_tokens_carry_no_loss(tiny_tokenizer, tiny_template):
    from trl import SFTConfig, SFTTrainer

    trajectories = demonstrations(tiny_tokenizer, tiny_template, n=4)
    dataset = sft_dataset(trajectories, include_failures=False, shortest_per_task=False)
    trainer = SFTTrainer(model=load_model(tiny_tokenizer.name_or_path),
                         args=SFTConfig(output_dir="/tmp/unused-sft", report_to="none", max_length=None,
                                        per_device_train_batch_size=4, use_cpu=True, bf16=False),
                         train_dataset=dataset.select_columns(["input_ids", "assistant_masks"]),
                         processing_class=tiny_tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    labels, ids = batch["labels"], batch["input_ids"]
    by_prompt = {tuple(t.tokens.prompt_ids + t.tokens.completion_ids): t for t in trajectories}
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist(), strict=True):
        key = next(k for k in by_prompt if tuple(row_ids[: len(k)]) == k)
        tokens = by_prompt[key].tokens
        mask = [0] * len(tokens.prompt_ids) + tokens.loss_mask
        for token, label, bit in zip(row_ids, row_labels, mask, strict=False):
            assert label == (token if bit else -100)
        trained_text = tiny_tokenizer.decode([t for t, b in zip(row_ids, mask, strict=False) if b],
                                             skip_special_tokens=False)
        assert "<|im_start|>" not in trained_text and "<tool_response>" not in trained_text
        assert trained_text.count("<|im_end|>") == 3, "each assistant turn's stop token is trained"


def test_sft_checkpoints_and_resumes(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path):
    dataset = sft_dataset(demonstrations(tiny_tokenizer, tiny_template), include_failures=False,
                          shortest_per_task=False)
    settings = SFTSettings(max_steps=2, batch_size=4, save_steps=1, logging_steps=1, warmup_steps=0)
    trajlab.sft(tiny_model_dir, dataset, tmp_path, tokenizer=tiny_tokenizer, **settings.model_dump())
    settings = settings.model_copy(update={"max_steps": 3})
    final = trajlab.sft(tiny_model_dir, dataset, tmp_path, tokenizer=tiny_tokenizer, resume=True,
                        **settings.model_dump())
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2, 3]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss/sft" in r] == [1, 2, 3], "resumed at 2: step 3 logged once"
    assert load_model(final).config.model_type == "qwen3"


def test_sft_with_lora_saves_a_merged_model(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path):
    dataset = sft_dataset(demonstrations(tiny_tokenizer, tiny_template), include_failures=False,
                          shortest_per_task=False)
    settings = SFTSettings(max_steps=1, batch_size=4, warmup_steps=0, lora=LoraSettings(r=4, alpha=8))
    final = trajlab.sft(tiny_model_dir, dataset, tmp_path, tokenizer=tiny_tokenizer, **settings.model_dump())
    merged = load_model(final)
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_sft_with_gradient_checkpointing_trains_a_step(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path):
    dataset = sft_dataset(demonstrations(tiny_tokenizer, tiny_template), include_failures=False,
                          shortest_per_task=False)
    model = load_model(tiny_model_dir)
    settings = SFTSettings(max_steps=1, batch_size=4, warmup_steps=0, logging_steps=1, gradient_checkpointing=True)
    trajlab.sft(model, dataset, tmp_path, tokenizer=tiny_tokenizer, **settings.model_dump())
    state = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1]


def test_sliced_loss_equals_the_full_logits_loss_and_trls_with_the_same_gradients(tiny_model_dir, tiny_tokenizer,
                                                                                   tiny_template, monkeypatch):
    import torch
    from trl import SFTConfig, SFTTrainer

    from trajlab.train import logprobs
    from trajlab.train.sft import SlicedLossTrainer

    monkeypatch.setattr(logprobs, "CHUNK_TOKENS", 16)  # many slices, the last one short
    dataset = sft_dataset(demonstrations(tiny_tokenizer, tiny_template, n=4), include_failures=False,
                          shortest_per_task=False)
    model = load_model(tiny_model_dir).train()
    trainer = SlicedLossTrainer(model=model, args=SFTConfig(output_dir="/tmp/unused-sft", report_to="none",
                                                            max_length=None, per_device_train_batch_size=4,
                                                            use_cpu=True, bf16=False),
                                train_dataset=dataset.select_columns(["input_ids", "assistant_masks"]),
                                processing_class=tiny_tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    labels = batch["labels"][:, 1:]
    assert (labels != -100).sum() > 3 * 16 and (labels == -100).any(), "several slices; prompt tokens masked"

    def loss(way, count):
        if way == "sliced":
            return trainer.compute_loss(model, dict(batch), num_items_in_batch=count)
        if way == "trl":  # TRL's own fused head: what SFT computed before
            return SFTTrainer.compute_loss(trainer, model, dict(batch), num_items_in_batch=count)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]  # (B, T, V)
        summed = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                   reduction="sum")
        return summed / ((labels != -100).sum() if count is None else count)

    for count in (None, 1000):  # the batch's own token count, or the accumulated batch's (num_items_in_batch)
        results = []
        for way in ("sliced", "trl", "full"):
            model.zero_grad()
            value = loss(way, count)
            value.backward()
            results.append((value.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
        (sliced, sliced_grad), (trl, trl_grad), (full, full_grad) = results
        assert torch.allclose(sliced, full, atol=1e-4, rtol=0) and torch.allclose(sliced, trl, atol=1e-4, rtol=0)
        assert torch.allclose(sliced_grad, full_grad, atol=1e-4, rtol=0)
        assert torch.allclose(sliced_grad, trl_grad, atol=1e-4, rtol=0)
    metrics = trainer._metrics["train"]  # sliced, then TRL's, per count: the same entropy and accuracy
    for name in ("entropy", "mean_token_accuracy"):
        assert metrics[name][0] == pytest.approx(metrics[name][1], abs=1e-4), name


def test_sliced_loss_of_a_bfloat16_model_under_the_trainers_mixed_precision(tiny_model_dir, tiny_tokenizer,
                                                                             tiny_template):
    """With bf16 on (as SFT runs on a GPU), accelerate wraps the model's forward in autocast and returns its outputs
    in float32: the head must run under the same autocast, as TRL's inside the forward does (seen on an H200: a
    float32 hidden state met the bfloat16 head)."""
    import torch
    from trl import SFTConfig, SFTTrainer

    from trajlab.train.sft import SlicedLossTrainer

    dataset = sft_dataset(demonstrations(tiny_tokenizer, tiny_template, n=4), include_failures=False,
                          shortest_per_task=False)
    model = load_model(tiny_model_dir, dtype="bfloat16").train()
    trainer = SlicedLossTrainer(model=model, args=SFTConfig(output_dir="/tmp/unused-sft", report_to="none",
                                                            max_length=None, per_device_train_batch_size=4,
                                                            use_cpu=True, bf16=True),
                                train_dataset=dataset.select_columns(["input_ids", "assistant_masks"]),
                                processing_class=tiny_tokenizer)
    model = trainer.accelerator.prepare_model(model)  # as train() does: forward under autocast, outputs in float32
    batch = next(iter(trainer.get_train_dataloader()))
    sliced = trainer.compute_loss(model, dict(batch))
    sliced.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)
    model.zero_grad()
    with trainer.accelerator.autocast():
        trl = SFTTrainer.compute_loss(trainer, model, dict(batch))
    assert sliced.item() == pytest.approx(trl.item(), rel=2e-2)
