"""Float32 master weights for bfloat16 training: what bfloat16 AdamW loses, what the masters keep, and that SFT and RL
use them (their checkpoints hold float32 moments and masters)."""

import itertools

import pytest
import torch

import trajlab
from trajlab.train.optim import MasterWeightAdamW, adamw

LR, STEPS = 1e-6, 20  # a real-model RL rate


def _trained(dtype: torch.dtype, optimizer: type, steps: int = STEPS) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    """A 512x512 layer drawn at Qwen3's initializer range (0.02), trained on a fixed linear objective."""
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(512, 512, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(512, 512, generator=generator) * 0.02)
    layer.to(dtype)
    inputs = torch.randn(8, 512, generator=generator).to(dtype)
    target = torch.randn(8, 512, generator=generator).to(dtype)
    chosen = optimizer(layer.parameters(), lr=LR)
    for _ in range(steps):
        (layer(inputs).float() * target.float()).sum().backward()
        chosen.step()
        chosen.zero_grad()
    return layer, chosen


def _start() -> torch.Tensor:
    return _trained(torch.float32, torch.optim.AdamW, steps=0)[0].weight.detach().clone()


def test_bfloat16_adamw_drops_small_updates_and_master_weights_keep_them():
    start = _start()
    full = _trained(torch.float32, torch.optim.AdamW)[0].weight.detach() - start
    plain = _trained(torch.bfloat16, torch.optim.AdamW)[0].weight.detach().float() - start.bfloat16().float()
    layer, optimizer = _trained(torch.bfloat16, MasterWeightAdamW)
    (_, master), = optimizer.pairs
    kept = master - start.bfloat16().float()

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()

    # measured: 2% of the weights moved (those within ~3e-4 of zero), cosine 0.13 to the float32 update
    assert (plain != 0).float().mean() < 0.05, "in place, 1e-6 updates round away on nearly every weight"
    assert cosine(plain, full) < 0.3
    assert cosine(kept, full) > 0.99  # measured 0.999
    assert kept.norm() == pytest.approx(full.norm().item(), rel=0.02), "the masters moved as float32 training did"
    assert torch.equal(layer.weight.detach(), master.bfloat16()), "the model's weights are the masters, rounded"
    assert all(state.dtype == torch.float32 for s in optimizer.state.values() for state in s.values()
               if state.dim() > 0), "the moments are float32"


def test_a_saved_state_resumes_from_the_unrounded_weights():
    layer, optimizer = _trained(torch.bfloat16, MasterWeightAdamW)
    saved = optimizer.state_dict()
    fresh = _trained(torch.bfloat16, MasterWeightAdamW, steps=0)[0]
    fresh.weight.data.copy_(layer.weight.data)
    resumed = MasterWeightAdamW(fresh.parameters(), lr=LR)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.pairs[0][1], optimizer.pairs[0][1])
    assert torch.equal(resumed.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])
    in_float32 = _trained(torch.float32, MasterWeightAdamW, steps=0)[1]  # same shapes, nothing to keep a master of
    with pytest.raises(ValueError, match="another model's state"):
        in_float32.load_state_dict(saved)


def test_float32_models_and_master_weights_off_keep_plain_adamw():
    full = torch.nn.Linear(4, 4)
    assert type(adamw(list(full.parameters()), master_weights=True, lr=LR)) is torch.optim.AdamW
    half = torch.nn.Linear(4, 4).bfloat16()
    assert type(adamw(list(half.parameters()), master_weights=False, lr=LR)) is torch.optim.AdamW
    assert type(adamw(list(half.parameters()), master_weights=True, lr=LR)) is MasterWeightAdamW


def _saved_optimizer(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _float32_state(state: dict) -> None:
    masters = state["master_weights"]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    moments = [v for s in state["state"].values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.dtype == torch.float32 for m in moments)


@pytest.mark.slow(5)
def test_sft_and_rl_train_a_bfloat16_model_with_float32_optimizer_state(tiny_model_dir, tmp_path):
    demos = trajlab.collect("arithmetic", "oracle", episodes=4, split="train", tokenizer=tiny_model_dir,
                            rollout={"max_turns": 4})
    final = trajlab.sft(tiny_model_dir, demos, tmp_path / "sft", max_steps=1, batch_size=2, save_steps=1,
                        device="cpu", dtype="bfloat16")
    assert trajlab.models.loading.saved_dtype(final) == torch.bfloat16
    _float32_state(_saved_optimizer(tmp_path / "sft" / "checkpoint-1" / "optimizer.pt"))

    trajlab.rl(tiny_model_dir, "arithmetic", tmp_path / "rl", steps=1, tasks_per_step=1, group_size=2,
               kl_coef=0.01, save_steps=1, device="cpu", dtype="bfloat16",
               rollout={"max_turns": 1, "max_new_tokens": 8})
    saved = next(itertools.chain((tmp_path / "rl").rglob("optimizer.bin"), (tmp_path / "rl").rglob("optimizer*")))
    _float32_state(_saved_optimizer(saved))
