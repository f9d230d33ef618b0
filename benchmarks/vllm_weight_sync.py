"""Weight sync into the vllm backend after an RL step: the LoRA adapter alone against the merged full weights.

    .venv-vllm/bin/python benchmarks/vllm_weight_sync.py     # the tiny model, then a real-width 2-layer Qwen3-0.6B

For each model, a LoRA model (rank ``--rank``, every linear layer, as ``rl.lora`` builds it) with its adapter moved
off zero is handed to two in-process engines of the CPU build of vLLM, both built here: one serving plain weights,
which gets every weight with the adapter merged in (``VLLMGenerator.load_named_weights(full_weights(model))``, the
only path before), and one serving adapters (``adapter_engine_args``), which gets the adapter alone
(``VLLMGenerator.load_adapter``: written to a folder and loaded in place of the previous one). Printed: the median
seconds of ``--reps`` syncs after one warm-up, and the bytes each moves.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from trajlab.inference.vllm import VLLMGenerator, adapter_engine_args, full_weights
from trajlab.models.archs import init_arch_model
from trajlab.models.loading import load_model
from trajlab.models.tiny import init_tiny_model


def median_seconds(sync: Callable[[], None], reps: int) -> float:
    sync()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model_dir: Path, rank: int, reps: int) -> dict[str, float]:
    model = get_peft_model(load_model(model_dir), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                             task_type="CAUSAL_LM"))
    with torch.no_grad():  # a trained adapter: B is zero at the start, which would merge to nothing
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    full_bytes = sum(t.numel() * t.element_size() for t in full_weights(model).values())
    plain = VLLMGenerator(model_dir, max_batch_size=4)
    full_s = median_seconds(lambda: plain.load_named_weights(full_weights(model)), reps)
    plain.llm.llm_engine.engine_core.shutdown()
    served = VLLMGenerator(model_dir, max_batch_size=4, engine_args=adapter_engine_args(rank))
    adapter_s = median_seconds(lambda: served.load_adapter(model), reps)
    return {"full_s": full_s, "adapter_s": adapter_s, "full_mb": full_bytes / 1e6, "adapter_mb": adapter_bytes / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-vllm-weight-sync")
    args = parser.parse_args()
    models = {"tiny": args.work / "tiny", "qwen3-0.6b, 2 layers": args.work / "qwen3-0.6b-2l"}
    if not (models["tiny"] / "config.json").is_file():
        init_tiny_model(models["tiny"], seed=0)
    if not (models["qwen3-0.6b, 2 layers"] / "config.json").is_file():
        init_arch_model("qwen3-0.6b", models["qwen3-0.6b, 2 layers"], layers=2, seed=0)
    rows = {name: measure(path, args.rank, args.reps) for name, path in models.items()}
    print(f"LoRA rank {args.rank}, median of {args.reps} syncs after a warm-up")
    print("| model | full weights merged: MB | s | adapter alone: MB | s | full / adapter seconds |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['full_mb']:.1f} | {row['full_s']:.3f} | {row['adapter_mb']:.2f} | "
              f"{row['adapter_s']:.3f} | {row['full_s'] / row['adapter_s']:.1f}x |")


if __name__ == "__main__":
    main()
