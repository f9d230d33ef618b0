"""What every GPU measurement shares: the scale, the benchmark models, the tool-latency env, timing and peak memory.

Each measurement module (``rl_step``, ``rollouts``, ``async_rl``, ``sft``, ``update_memory``) exposes
``measure(scale: Scale, work: Path) -> dict`` and runs in its own fresh interpreter (``run.py --one NAME``), so the
peak memory it reports is its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/, after this folder: _latency, rl_memory...

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim")
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}


@dataclasses.dataclass(frozen=True)
class Scale:
    """Every size the measurements use: ``full()`` on the GPU, ``for_smoke()`` on a CPU in minutes."""

    smoke: bool
    device: str
    arch: str
    shape: dict[str, int]  # the architecture's sizes: the published ones on the GPU, a 64-wide Qwen3 in the smoke run
    vocab_size: int  # Qwen3's, with its real tokenizer, on the GPU; above the tiny tokenizer's in the smoke run
    repeats: int  # timed repetitions after one warm-up; the median is reported
    warm_start_steps: int  # SFT steps on reference demos, so the random model writes tool calls
    warm_start_lr: float
    tasks_per_step: int
    group_size: int
    max_turns: int
    max_new_tokens: int
    tool_latency_s: float  # async_rl's tools: long enough that rollouts and updates take similar time
    step_tool_latency_s: float  # rl_step's: TRL calls a synchronous tool's calls one after another, so keep it short
    async_steps: int
    rollout_batch: int  # rollouts measurement: prompts per batch
    rollout_prompt: int  # and their length in tokens
    sft_tokens: int
    update_tokens: tuple[int, ...]

    @classmethod
    def full(cls, arch: str = "qwen3-0.6b") -> Scale:
        from trajlab.models.archs import ARCHS

        config = ARCHS[arch].config
        return cls(smoke=False, device="cuda", arch=arch, shape={key: config[key] for key in SHAPE_KEYS},
                   vocab_size=config["vocab_size"], repeats=3,
                   warm_start_steps=100, warm_start_lr=1e-3,
                   tasks_per_step=8, group_size=8, max_turns=4, max_new_tokens=256,
                   tool_latency_s=0.5, step_tool_latency_s=0.05, async_steps=4,
                   rollout_batch=64, rollout_prompt=256, sft_tokens=4096, update_tokens=(2048, 8192, 32768))

    @classmethod
    def for_smoke(cls) -> Scale:
        return cls(smoke=True, device="cpu", arch="smoke", shape=SMOKE_SHAPE, vocab_size=2048, repeats=3,
                   warm_start_steps=80, warm_start_lr=1e-2,
                   tasks_per_step=2, group_size=2, max_turns=3, max_new_tokens=32,
                   tool_latency_s=0.05, step_tool_latency_s=0.01, async_steps=3,
                   rollout_batch=4, rollout_prompt=32, sft_tokens=256, update_tokens=(128, 256))

    @property
    def dtype(self) -> str:
        return "float32" if self.smoke else "bfloat16"


def scale_from_json(text: str) -> Scale:
    fields = json.loads(text)
    fields["update_tokens"] = tuple(fields["update_tokens"])
    return Scale(**fields)


# --- models ---


def build_random_model(scale: Scale, out: Path, seed: int = 0) -> Path:
    """A randomly initialised model of ``scale``, saved in ``scale.dtype``. On the GPU, a twin of ``scale.arch``
    (``trajlab model init --arch``): its config, stop tokens, real Qwen3 tokenizer and chat template. In the smoke run,
    a 64-wide Qwen3 with the tiny offline tokenizer (its ids a prefix of the vocabulary), whose short sequences and
    small vocabulary let a CPU teach it tool calls in a minute. Cached: an existing directory is reused."""
    if (out / "config.json").exists():
        return out
    return _smoke_model(scale, out, seed) if scale.smoke else _twin_model(scale, out, seed)


def _twin_model(scale: Scale, out: Path, seed: int) -> Path:
    from trajlab.models.archs import init_arch_model

    if scale.dtype != "bfloat16":
        raise ValueError(f"a twin is saved in bfloat16, as the real checkpoint; the scale asks for {scale.dtype}")
    return init_arch_model(scale.arch, out, seed=seed)


def _smoke_model(scale: Scale, out: Path, seed: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trajlab.models.loading import load_tokenizer
    from trajlab.models.tiny import init_tiny_model, save_tiny_model

    tiny = init_tiny_model(out.parent / "tiny-tokenizer-source", seed=seed, overwrite=True)
    tokenizer = load_tokenizer(tiny)
    config = Qwen3Config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, vocab_size=scale.vocab_size, tie_word_embeddings=True, **scale.shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(getattr(torch, scale.dtype))
    return save_tiny_model(model, tokenizer, tokenizer, out)


def warm_started_model(scale: Scale, work: Path, seed: int = 0) -> Path:
    """The random model after ``scale.warm_start_steps`` of SFT on the arithmetic env's reference demonstrations,
    so that it writes parseable tool calls and RL episodes take several turns. Cached in ``work``."""
    import trajlab
    from trajlab.data.store import read_trajectories
    from trajlab.env.builtin.arithmetic import SPEC

    out = work / f"{scale.arch}-warm{scale.warm_start_steps}"
    if (out / "config.json").exists():
        return out
    base = build_random_model(scale, work / f"{scale.arch}-random", seed)
    demos = work / "warm-start-demos.jsonl"
    if not demos.exists():
        trajlab.collect(SPEC, "oracle", out=demos, episodes=400, seed=seed + 1, tokenizer=str(base),
                        rollout={"concurrency": 64})
    progress(f"warm start: {scale.warm_start_steps} SFT steps on {demos.name}")
    run = work / f"warm-start-run-{scale.warm_start_steps}"
    trajlab.sft(str(base), list(read_trajectories(demos)), run, device=scale.device,
                dtype=scale.dtype, max_steps=scale.warm_start_steps, batch_size=16, warmup_steps=10, save_steps=10**9,
                learning_rate=scale.warm_start_lr)
    _save_as(run / "final", out, scale.dtype)
    return out


def _save_as(source: Path, out: Path, dtype: str) -> None:
    import torch

    from trajlab.models.loading import load_model, load_tokenizer

    model = load_model(source, device="cpu", dtype="float32").to(getattr(torch, dtype))
    model.save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)


# --- the tool-latency env ---


def latency_env(latency_s: float) -> Any:
    """The arithmetic env with every tool sleeping ``latency_s`` first (benchmarks/_latency.py)."""
    from _latency import slow_tools

    from trajlab.env.builtin.arithmetic import SPEC

    return slow_tools(SPEC, latency_s)


# --- timing, memory, progress ---


def progress(message: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def median_after_warmup(run: Callable[[], dict[str, float]], repeats: int, label: str,
                        budget_s: float | None = None) -> dict[str, Any]:
    """One warm-up call, then ``repeats`` timed ones (fewer once ``budget_s`` of them have passed; at least one):
    the median of each number ``run`` returns, and every rep."""
    progress(f"{label}: warm-up")
    warmup = run()
    reps = []
    began = time.perf_counter()
    while len(reps) < repeats and not (reps and budget_s is not None and time.perf_counter() - began > budget_s):
        reps.append(run())
        progress(f"{label}: repetition {len(reps)}/{repeats}: " + ", ".join(
            f"{key} {value:.3g}" for key, value in reps[-1].items() if isinstance(value, int | float)))
    if len(reps) < repeats:
        progress(f"{label}: {len(reps)} of {repeats} repetitions within {budget_s:g} s")
    keys = [key for key, value in reps[0].items() if isinstance(value, int | float)]
    return {"median": {key: statistics.median(rep[key] for rep in reps) for key in keys}, "reps": reps,
            "warmup": warmup}


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> float:
    """Peak GPU memory allocated since :func:`reset_peak` on a GPU; on the CPU the process's peak RSS (smoke runs:
    the number only has to be there)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# --- a measurement's workers: each side or length in its own interpreter ---


def spawn_worker(script: str, key: str | int, scale: Scale, work: Path,
                 timeout_s: float | None = None) -> dict[str, Any]:
    """``script``'s worker for ``key`` in a fresh interpreter (see :func:`worker_main`), offline: its result, or
    ``{"error": ...}`` with the end of its stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # no network: a hub lookup (e.g. a flash kernel) fails at once
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, script, "--worker", str(key), "--scale", json.dumps(dataclasses.asdict(scale)),
                   "--work", str(work), "--out", str(out)]
        try:
            done = subprocess.run(command, stderr=subprocess.PIPE, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s"}
        if done.returncode == 0 and out.exists():
            return json.loads(out.read_text())
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["(no stderr)"]
        sys.stderr.write("\n".join(lines[-30:]) + "\n")
        return {"error": f"exit {done.returncode}: {lines[-1][:300]}"}


def worker_main(worker: Callable[[Any, Scale, Path], dict[str, Any]], key_type: Callable[[str], Any] = str) -> None:
    """A worker's interpreter, started by :func:`spawn_worker`: ``worker(key, scale, work)`` to ``--out``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=key_type, required=True)
    parser.add_argument("--scale", required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(worker(args.worker, scale_from_json(args.scale), args.work), indent=1))
