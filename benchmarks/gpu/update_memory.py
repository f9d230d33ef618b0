"""The RL update's peak GPU memory against its length: it grows with the tokens, never with tokens x vocabulary.

At each of ``scale.update_tokens`` N, in its own interpreter: the random model (``build_random_model``, in
``scale.dtype``) with activation checkpointing on, as ``rl.gradient_checkpointing=True`` sets it (without it a 0.6B
Qwen3 keeps ~3.5 MB of activations a token: over 100 GB at 32,768); a batch of ``ROWS`` episodes of N / ``ROWS``
random tokens, the first eighth of each prompt (``benchmarks/rl_memory.py``'s ``synthetic_batch``); one
forward + backward + AdamW step of each framework's loss (``rl_memory.update_loss``), no KL term, temperature 1:

- ``trajlab``: ``trajlab.train.loss.policy_loss`` (logprobs from ``trajlab.train.logprobs``: the LM head a slice at
  a time, recomputed in the backward pass);
- ``trl``: ``GRPOTrainer._compute_loss`` of a TRL trainer on the same model and batch (``loss_type="grpo"``,
  ``beta=0``), after trajlab's: the trainer patches TRL's fused LM head into the model.

Each framework gets its own AdamW and a warm-up step on a short batch (kernels loaded, the optimizer's state
allocated), then the peak is reset and the measured step runs at full length. The table gives each length's peak, the
step's seconds, and the growth per token between lengths set against what a (length x vocabulary) float32 logits
tensor alone would add: vocabulary x 4 bytes a token (608 KB with Qwen3's 151,936).

H100 estimate (0.6B, bfloat16; 2,048 / 8,192 / 32,768 tokens): per length ~10 s of imports, loading and TRL's
trainer; the measured steps ~0.2 / 0.7 / 2.5 s for each framework; TRL's Triton kernels compile once (disk cache)
in the first warm-up: ~45 s in all. Peaks expected ~5 / 6 / 11 GB: ~180 KB a token (checkpointed layer inputs, one
layer recomputed), a third of a float32 logits row.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # benchmarks/: rl_memory's update pieces
import rl_memory  # noqa: E402
from common import (  # noqa: E402
    Scale,
    build_random_model,
    peak_gb,
    progress,
    reset_peak,
    spawn_worker,
    synchronize,
    worker_main,
)

ROWS = 2  # episodes in the batch; GRPO's loss (and TRL's trainer) wants a group
WARMUP_TOKENS = 128  # per row in the warm-up step: its prompt (16) and completion (112) are multiples of 16, as
# the measured lengths' are, so TRL's Triton kernels compile there for the measured step too
FRAMEWORKS = ("trajlab", "trl")


def measured_step(framework: str, model: Any, tokens: int, scale: Scale, model_dir: Path) -> dict[str, float]:
    """``framework``'s warm-up step on a short batch, then its measured step on ``tokens``: seconds and peak memory."""
    import torch

    def batch(row: int, seed: int) -> dict[str, Any]:
        return rl_memory.synthetic_batch(ROWS, row, row // 8, seed, vocab=scale.vocab_size, device=scale.device)

    model, loss = rl_memory.update_loss(framework, model, model_dir, ROWS, scale.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(rows: dict[str, Any]) -> float:
        synchronize(scale.device)
        began = time.perf_counter()
        loss(rows).backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(scale.device)
        return time.perf_counter() - began

    step(batch(WARMUP_TOKENS, seed=1))
    measured = batch(tokens // ROWS, seed=0)
    reset_peak(scale.device)
    seconds = step(measured)
    result = {"peak_gb": peak_gb(scale.device), "seconds": seconds}
    progress(f"update_memory {tokens} tokens, {framework}: peak {result['peak_gb']:.2f} GB, {seconds:.2f} s")
    return result


def worker(tokens: int, scale: Scale, work: Path) -> dict[str, Any]:
    """Both frameworks' measured steps at ``tokens`` in this interpreter, trajlab first (TRL's trainer patches the
    model), each after the other's optimizer and gradients are gone."""
    import torch

    from trajlab.models.loading import load_model

    model_dir = build_random_model(scale, work / f"{scale.arch}-random")
    model = load_model(model_dir, device=scale.device, dtype=scale.dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    results = {}
    for framework in FRAMEWORKS:
        try:
            results[framework] = measured_step(framework, model, tokens, scale, model_dir)
        except torch.OutOfMemoryError as e:
            results[framework] = {"error": f"out of memory: {str(e).splitlines()[0][:200]}"}
        model.zero_grad(set_to_none=True)  # what a failed step left
        gc.collect()
        if scale.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return results


def run_length(tokens: int, scale: Scale, work: Path) -> dict[str, Any]:
    """``tokens`` in a fresh interpreter; its result per framework, or its error for both."""
    result = spawn_worker(__file__, tokens, scale, work)
    return dict.fromkeys(FRAMEWORKS, result) if "error" in result else result


def measure(scale: Scale, work: Path) -> dict[str, Any]:
    """Every length in its own interpreter, shortest first; the growth per token between consecutive lengths."""
    lengths = {}
    for tokens in scale.update_tokens:
        progress(f"update_memory: {tokens} tokens")
        lengths[str(tokens)] = run_length(tokens, scale, work)
    if all("error" in r for by_framework in lengths.values() for r in by_framework.values()):
        raise RuntimeError("every update failed: " + next(iter(lengths.values()))["trajlab"]["error"])
    growth = {framework: growth_per_token(lengths, framework) for framework in FRAMEWORKS}
    return {"rows": ROWS, "vocab_size": scale.vocab_size, "logits_bytes_per_token": scale.vocab_size * 4,
            "lengths": lengths, "growth_bytes_per_token": growth}


def growth_per_token(lengths: dict[str, dict[str, Any]], framework: str) -> dict[str, float]:
    """Extra peak bytes per extra token from each measured length to the next, keyed by the longer one."""
    measured = [(int(tokens), r[framework]["peak_gb"]) for tokens, r in lengths.items() if "peak_gb" in r[framework]]
    return {str(b): (peak_b - peak_a) * 2**30 / (b - a) for (a, peak_a), (b, peak_b) in zip(measured, measured[1:],
                                                                                          strict=False)}


def table(result: dict[str, Any]) -> str:
    """Each length's peak and step time per framework, with the growth per token against a logits tensor's."""
    logits = result["logits_bytes_per_token"]
    lines = [f"one RL update (forward + backward + AdamW, GRPO loss, no KL), {result['rows']} episodes of N / "
             f"{result['rows']} tokens, an eighth of each prompt; activation checkpointing on; vocabulary "
             f"{result['vocab_size']:,}", "",
             "| tokens N | framework | peak GB | step s | growth since the length before, bytes/token | "
             "vs a float32 logits tensor's (vocab x 4 bytes) |", "|---|---|---|---|---|---|"]
    for tokens, by_framework in result["lengths"].items():
        for framework in FRAMEWORKS:
            r = by_framework[framework]
            if "error" in r:
                lines.append(f"| {int(tokens):,} | {framework} | failed: {r['error']} | | | |")
                continue
            growth = result["growth_bytes_per_token"][framework].get(tokens)
            shown = ("", "") if growth is None else (f"{growth:,.0f}", f"{growth / logits:.2f}x of {logits:,}")
            lines.append(f"| {int(tokens):,} | {framework} | {r['peak_gb']:.2f} | {r['seconds']:.2f} | {shown[0]} | "
                         f"{shown[1]} |")
    lines += ["", "A (length x vocabulary) float32 logits tensor alone would add vocab x 4 bytes a token, and its "
              "log-softmax and gradient as much again each; growth well under 1x of it means the step keeps no such "
              "tensor. The peak is reset after a warm-up step, so it holds weights, AdamW's state and the step. "
              "On a CPU the peaks are the process's peak RSS, which never goes down: the TRL row there includes "
              "trajlab's step and the growth column means nothing."]
    return "\n".join(lines)


if __name__ == "__main__":
    worker_main(worker, int)
