"""Checkpoints and what trainers write, on the real tiny model: RL's checkpoint round trip, a crash mid-save that
leaves the last checkpoint whole, the metrics log a resumed run continues without repeating steps, the final model."""

import json

import pytest
import torch
from accelerate import Accelerator

from trajlab.models.loading import load_model, load_tokenizer
from trajlab.train.checkpoints import CHECKPOINT, MetricsLog, load_checkpoint, save_checkpoint, save_final


def trained(model_dir, accelerator, steps):
    """The tiny model and AdamW after ``steps`` steps on a fixed batch: weights and optimizer state not at start."""
    model = load_model(model_dir, device="cpu").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.arange(2, 18).view(2, 8)
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_checkpoint_brings_back_weights_optimizer_and_state(tiny_model_dir, tmp_path):
    accelerator = Accelerator(cpu=True)
    model, optimizer = trained(tiny_model_dir, accelerator, steps=2)
    save_checkpoint(accelerator, tmp_path, 7, {"curriculum": {"stage": 1}})
    assert json.loads((tmp_path / CHECKPOINT / "trajlab_state.json").read_text()) == {
        "step": 7, "curriculum": {"stage": 1}}

    fresh_accelerator = Accelerator(cpu=True)
    fresh, fresh_optimizer = trained(tiny_model_dir, fresh_accelerator, steps=0)
    assert not torch.equal(next(fresh.parameters()), next(model.parameters()))
    step, state = load_checkpoint(fresh_accelerator, tmp_path)
    assert (step, state["curriculum"]) == (7, {"stage": 1})
    for mine, theirs in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    first = next(iter(optimizer.state.values()))
    assert torch.equal(next(iter(fresh_optimizer.state.values()))["exp_avg"], first["exp_avg"])
    assert load_checkpoint(Accelerator(cpu=True), tmp_path / "elsewhere") == (0, {})


def test_a_crash_mid_save_leaves_the_last_checkpoint_whole(tiny_model_dir, tmp_path, monkeypatch):
    accelerator = Accelerator(cpu=True)
    trained(tiny_model_dir, accelerator, steps=1)
    save_checkpoint(accelerator, tmp_path, 1, {})
    before = sorted(p.name for p in (tmp_path / CHECKPOINT).iterdir())

    def dies_halfway(path):
        (tmp_path / f"{CHECKPOINT}.partial").mkdir(exist_ok=True)
        (tmp_path / f"{CHECKPOINT}.partial" / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt  # as a kill would: nothing after it runs

    monkeypatch.setattr(accelerator, "save_state", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(accelerator, tmp_path, 2, {})
    assert sorted(p.name for p in (tmp_path / CHECKPOINT).iterdir()) == before
    monkeypatch.undo()
    assert load_checkpoint(Accelerator(cpu=True), tmp_path)[0] == 1
    save_checkpoint(accelerator, tmp_path, 2, {})  # the next save writes over the half-written one
    assert load_checkpoint(Accelerator(cpu=True), tmp_path)[0] == 2
    assert not (tmp_path / f"{CHECKPOINT}.partial").exists()


def test_a_resumed_run_logs_no_step_twice_and_a_fresh_run_starts_the_log_anew(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, resumed_at=None)
    for step in (1, 2, 3):  # a run killed after logging step 3, its last checkpoint at step 2
        log.write({"step": step, "loss": 0.1 * step})
    resumed = MetricsLog(path, resumed_at=2)
    resumed.write({"step": 3, "loss": 0.25})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}, {"step": 3, "loss": 0.25}]
    MetricsLog(path, resumed_at=None)
    assert not path.exists(), "a run that does not resume keeps nothing of an earlier one"


def test_the_final_model_is_a_plain_model_directory(tiny_model_dir, tmp_path):
    accelerator = Accelerator(cpu=True)
    model, _ = trained(tiny_model_dir, accelerator, steps=1)
    final = save_final(accelerator.unwrap_model(model), load_tokenizer(tiny_model_dir), None, tmp_path / "final",
                       lora=False, accelerator=accelerator)
    reloaded = load_model(final, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.parameters(), model.parameters(), strict=True))
    assert load_tokenizer(final).chat_template == load_tokenizer(tiny_model_dir).chat_template
