"""Rollout batches on the GPU: trajlab's ``hf`` backend against plain ``model.generate`` (the floor), and
transformers' continuous batching (``model.generate_batch``) against the same backend, each as a fraction of what
the memory bandwidth allows.

The batch, as in ``benchmarks/rl_memory.py``'s rollout part: ``scale.rollout_batch`` prompts of
``scale.rollout_prompt`` random ids below the tokenizer's size, each continued by exactly ``scale.max_new_tokens``
tokens sampled at temperature 1 from the whole distribution (the model's eos is unset, so no row stops early; every
side's token count is checked). The sides, each alone in a fresh interpreter so peaks and CUDA state never mix:

- ``generate``: ``model.generate(do_sample=True, top_k=0, top_p=1)`` on the batch, one call;
- ``trajlab``: ``load_policy(model_dir, backend="hf")``'s ``HFGenerator``, every prompt at once (one batch), its
  per-token logprobs recorded; its prefix cache is cleared before each batch so every batch reads its prompts;
- ``continuous``: ``model.generate_batch`` with ``ContinuousBatchingConfig(return_logprobs=True)``, its paged cache
  sized to the batch (``num_blocks``, ``max_batch_tokens``; left to itself it sizes them from free memory: on the
  2-core CPU, 22-24 s a batch of the smoke run instead of ~1 s under 5.23, killed under 5.17: likely the ~14x of
  BENCHMARKS.md) and kept between calls (``persistent_manager``), as an RL loop would keep it. Only options present
  in transformers 5.17 and 5.23. A failure here is recorded, not raised.

One warm-up batch, then ``scale.repeats`` timed ones, or fewer when they pass ``REPS_BUDGET_S`` (at least one);
the median is reported, the peak memory is over all of them.
The physical limit: a decode step reads every weight once and the batch's key/value cache at the mean context length
(prompt + half the new tokens): ``2 x layers x kv_heads x head_dim x dtype bytes x context x batch``; divided by the
memory bandwidth, measured in the floor's interpreter after its batches (a device-to-device copy, bytes read +
written over time, median of ``COPY_REPEATS``), that is the shortest a step can take.

Measured on an H200 (2026-11-27, BENCHMARKS.md): ~18 s a side of imports, CUDA start and loading; plain
``generate`` and trajlab 7-10 s a batch; continuous batching a 59 s warm-up, then 28 s a batch, which took the first
run past its budget. So the timed batches stop at ``REPS_BUDGET_S`` (continuous batching: one) and
``WORKER_TIMEOUT_S`` caps a side that hangs or crawls: ~70 + ~65 + ~110 = ~245 s in all.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Scale,
    build_random_model,
    median_after_warmup,
    peak_gb,
    progress,
    reset_peak,
    spawn_worker,
    synchronize,
    worker_main,
)

SIDES = {"generate": "plain `model.generate` (floor)", "trajlab": "trajlab `hf` backend",
         "continuous": "transformers continuous batching"}
WORKER_TIMEOUT_S = {True: 120.0, False: 150.0}
REPS_BUDGET_S = 30.0  # no further timed batch starts after this many seconds of them
COPY_BYTES = {True: 64 << 20, False: 1 << 30}  # well above the CPU's last-level cache / the H100's 50 MB L2
COPY_REPEATS = 5
CB_BLOCK = 256  # ContinuousBatchingConfig's default block (5.17: block_size, 5.23: page_size)
TRAJLAB_TARGET = 1.2  # trajlab's batch within this many times the floor's


# --- inside a side's interpreter ---


def _prompts(tokenizer: Any, scale: Scale) -> list[list[int]]:
    """The same random prompts on every side: ordinary tokens only (no special or added ones)."""
    import torch

    ordinary = torch.tensor(sorted(set(range(tokenizer.vocab_size)) - set(tokenizer.all_special_ids)))
    generator = torch.Generator().manual_seed(0)
    return [ordinary[torch.randint(0, len(ordinary), (scale.rollout_prompt,), generator=generator)].tolist()
            for _ in range(scale.rollout_batch)]


def _timed(scale: Scale, call: Callable[[], int]) -> Callable[[], dict[str, float]]:
    """``call`` (which generates the batch and returns its token count) timed with the device synchronised."""

    def run() -> dict[str, float]:
        synchronize(scale.device)
        began = time.perf_counter()
        tokens = call()
        synchronize(scale.device)
        expected = scale.rollout_batch * scale.max_new_tokens
        if tokens != expected:
            raise RuntimeError(f"generated {tokens} tokens, expected {expected}: a row stopped early or failed")
        return {"seconds": time.perf_counter() - began, "tokens": tokens}

    return run


def _generate_side(scale: Scale, model_dir: Path) -> tuple[Any, Callable[[], dict[str, float]]]:
    """The floor: the model and one ``generate`` call for the whole batch, nothing recorded on top."""
    import torch

    from trajlab.models.loading import load_model, load_tokenizer

    model = load_model(model_dir, device=scale.device, dtype=scale.dtype)
    model.generation_config.eos_token_id = None  # every row generates exactly max_new_tokens
    tokenizer = load_tokenizer(model_dir)
    input_ids = torch.tensor(_prompts(tokenizer, scale), device=model.device)  # (B, P): equal lengths, no padding

    @torch.inference_mode()
    def call() -> int:
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                             max_new_tokens=scale.max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=tokenizer.pad_token_id, use_cache=True)
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    return model, _timed(scale, call)


def _trajlab_side(scale: Scale, model_dir: Path) -> tuple[Any, Callable[[], dict[str, float]]]:
    """The backend as RL builds it (``load_policy``), every prompt a request of one batch, as a step's turns are."""
    import asyncio

    from trajlab.inference.base import GenerationRequest, SamplingParams
    from trajlab.inference.policy import load_policy

    policy = load_policy(str(model_dir), device=scale.device, dtype=scale.dtype, backend="hf",
                         max_batch_size=scale.rollout_batch)
    hf = policy.generator  # stops only at params.stop_token_ids: none here
    prompts = _prompts(policy.tokenizer, scale)
    params = SamplingParams(max_new_tokens=scale.max_new_tokens, temperature=1.0)

    async def batch() -> list[Any]:
        return await asyncio.gather(*(hf.generate(GenerationRequest(p, params)) for p in prompts))

    def call() -> int:
        hf.prefix_cache.clear()  # each batch reads its prompts again, as a first turn does
        return sum(len(result.token_ids) for result in asyncio.run(batch()))

    return hf.model, _timed(scale, call)


def _continuous_side(scale: Scale, model_dir: Path) -> tuple[Any, Callable[[], dict[str, float]]]:
    """transformers' own batch API, with the logprobs trajlab records too, so both sides return the same."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from trajlab.models.loading import load_model, load_tokenizer

    model = load_model(model_dir, device=scale.device, dtype=scale.dtype)
    model.generation_config.eos_token_id = model.config.eos_token_id = None  # generate_batch falls back on both
    tokenizer = load_tokenizer(model_dir)
    prompts = _prompts(tokenizer, scale)
    blocks = scale.rollout_batch * (math.ceil((scale.rollout_prompt + scale.max_new_tokens) / CB_BLOCK) + 1)
    cb_config = ContinuousBatchingConfig(return_logprobs=True, num_blocks=blocks,
                                         max_batch_tokens=min(8192, scale.rollout_batch * scale.rollout_prompt))

    def call() -> int:
        generation = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                                      pad_token_id=tokenizer.pad_token_id, max_new_tokens=scale.max_new_tokens)
        outputs = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb_config,
                                       persistent_manager=True)
        failed = [output.error for output in outputs.values() if output.error]
        if failed or len(outputs) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(prompts)} rows; errors: {failed[:2]}")
        return sum(len(output.generated_tokens) for output in outputs.values())

    return model, _timed(scale, call)


def _median_of_batches(run: Callable[[], dict[str, float]], scale: Scale, label: str) -> dict[str, Any]:
    """``common.median_after_warmup`` over whole batches, flattened for the table."""
    measured = median_after_warmup(run, scale.repeats, label, budget_s=REPS_BUDGET_S)
    return {"seconds": measured["median"]["seconds"], "tokens": measured["warmup"]["tokens"],
            "reps_s": [rep["seconds"] for rep in measured["reps"]], "warmup_s": measured["warmup"]["seconds"]}


def _bandwidth_gbs(scale: Scale) -> dict[str, Any]:
    """Memory bandwidth measured here: a large copy reads and writes every byte once."""
    import torch

    source = torch.ones(COPY_BYTES[scale.smoke], dtype=torch.uint8, device=scale.device)
    target = torch.empty_like(source)
    times = []
    for _ in range(1 + COPY_REPEATS):  # the first is a warm-up
        synchronize(scale.device)
        began = time.perf_counter()
        target.copy_(source)
        synchronize(scale.device)
        times.append(time.perf_counter() - began)
    rates = [2 * source.numel() / seconds / 1e9 for seconds in times[1:]]
    return {"gbs": statistics.median(rates), "reps_gbs": rates, "copy_bytes": source.numel()}


def worker(side: str, scale: Scale, work: Path) -> dict[str, Any]:
    """One side in this fresh interpreter: its batches' timing and peak memory; the floor's also measures the
    bandwidth, after its peak is read (a copy buffer would raise a CPU's peak RSS, which cannot be reset). The
    model is built here, not in :func:`measure`, whose interpreter then never imports torch."""
    import torch

    model_dir = build_random_model(scale, work / f"{scale.arch}-random")  # cached after the first side
    torch.manual_seed(0)
    if scale.smoke:  # on a busy 2-core CPU two OpenMP threads stop spin-waiting: the tiny model's steps take ~10x
        torch.set_num_threads(1)
    build = {"generate": _generate_side, "trajlab": _trajlab_side, "continuous": _continuous_side}[side]
    model, run = build(scale, model_dir)
    reset_peak(scale.device)
    result = _median_of_batches(run, scale, f"rollouts {side}")
    result["peak_gb"] = peak_gb(scale.device)
    result["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    if side == "generate":
        del model, run
        result["bandwidth"] = _bandwidth_gbs(scale)
    return result


# --- the measurement ---


def _spawn(side: str, scale: Scale, work: Path) -> dict[str, Any]:
    """``side`` in a fresh interpreter; its result, or ``{"error": ...}``."""
    progress(f"rollouts: {side} in a fresh interpreter")
    return spawn_worker(__file__, side, scale, work, timeout_s=WORKER_TIMEOUT_S[scale.smoke])


def _physical_limit(scale: Scale, weight_bytes: int, bandwidth_gbs: float) -> dict[str, float]:
    """Decode tokens/s if every step only read the weights and the batch's key/value cache at full bandwidth."""
    shape = scale.shape
    context = scale.rollout_prompt + scale.max_new_tokens / 2  # mean over the decode steps
    dtype_bytes = 4 if scale.dtype == "float32" else 2
    kv_bytes = (2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes
                * context * scale.rollout_batch)
    step_bytes = weight_bytes + kv_bytes
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "mean_context": context, "step_bytes": step_bytes,
            "step_s": step_bytes / (bandwidth_gbs * 1e9),
            "tokens_per_s": scale.rollout_batch * bandwidth_gbs * 1e9 / step_bytes}


def measure(scale: Scale, work: Path) -> dict[str, Any]:
    """The three sides, the floor first; raises if the floor or trajlab fails (continuous batching's failure is
    recorded)."""
    sides: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        sides[side] = _spawn(side, scale, work)
        if side != "continuous" and "error" in sides[side]:
            raise RuntimeError(f"rollouts {side}: {sides[side]['error']}")
    floor = sides["generate"]
    limit = _physical_limit(scale, floor["weight_bytes"], floor["bandwidth"]["gbs"])
    for result in sides.values():
        if "error" not in result:
            result["tokens_per_s"] = result["tokens"] / result["seconds"]
            result["vs_floor"] = result["seconds"] / floor["seconds"]
            result["of_limit"] = result["tokens_per_s"] / limit["tokens_per_s"]
    return {"batch": scale.rollout_batch, "prompt_tokens": scale.rollout_prompt, "new_tokens": scale.max_new_tokens,
            "dtype": scale.dtype, "sides": sides, "bandwidth": floor["bandwidth"], "limit": limit,
            "trajlab_vs_floor": sides["trajlab"]["vs_floor"],
            "continuous_vs_trajlab": (sides["continuous"]["seconds"] / sides["trajlab"]["seconds"]
                                      if "error" not in sides["continuous"] else None)}


def table(result: dict[str, Any]) -> str:
    """The sides as Markdown rows, then the targets and how the physical limit was reached."""
    limit, bandwidth = result["limit"], result["bandwidth"]
    lines = [f"{result['batch']} prompts x {result['prompt_tokens']} random tokens, {result['new_tokens']} new tokens "
             f"each, temperature 1, {result['dtype']}; median of the timed batches after one warm-up", "",
             "| side | s/batch | timed batches s | decode tokens/s | peak GB | time vs floor | of physical limit |",
             "|---|---|---|---|---|---|---|"]
    for side, label in SIDES.items():
        r = result["sides"][side]
        if "error" in r:
            lines.append(f"| {label} | FAILED: {r['error']} | | | | | |")
            continue
        reps = " ".join(f"{seconds:.2f}" for seconds in r["reps_s"])
        lines.append(f"| {label} | {r['seconds']:.3f} | {reps} | {r['tokens_per_s']:,.0f} | {r['peak_gb']:.2f} | "
                     f"{r['vs_floor']:.2f}x | {r['of_limit']:.1%} |")
    ratio = result["trajlab_vs_floor"]
    verdict = "met" if ratio <= TRAJLAB_TARGET else "NOT met"
    lines += ["", f"**Target: trajlab within {TRAJLAB_TARGET}x of plain generate: {verdict} ({ratio:.2f}x).**"]
    cb = result["continuous_vs_trajlab"]
    lines.append("Continuous batching against trajlab's `hf` backend, same batch: " + (
        f"{cb:.2f}x trajlab's time." if cb is not None else "not measured (its error is in the row above)."))
    lines += ["", f"Bandwidth measured: {bandwidth['gbs']:,.0f} GB/s (a {bandwidth['copy_bytes'] / 2**20:,.0f} MiB "
              f"copy, read + written, median of {len(bandwidth['reps_gbs'])}). Physical limit: a decode step reads "
              f"{limit['weight_bytes'] / 1e9:.3g} GB of weights + {limit['kv_bytes'] / 1e9:.3g} GB of key/value cache "
              f"(mean context {limit['mean_context']:.0f} tokens x {result['batch']} rows) = "
              f"{limit['step_bytes'] / 1e9:.3g} GB, at least {limit['step_s'] * 1e3:.3g} ms: "
              f"{limit['tokens_per_s']:,.0f} decode tokens/s. Prefill is inside each side's time."]
    return "\n".join(lines)


if __name__ == "__main__":
    worker_main(worker)
