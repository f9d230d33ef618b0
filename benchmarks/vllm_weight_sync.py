"""Weight sync into the vllm backend after an RL step: the LoRA adapter alone, and full weights streamed to a
server, against the in-process copy of the merged full weights.

    .venv-vllm/bin/python benchmarks/vllm_weight_sync.py     # the tiny model, then a real-width 2-layer Qwen3-0.6B

For each model, a LoRA model (rank ``--rank``, every linear layer, as ``rl.lora`` builds it) with its adapter moved
off zero is handed to two in-process engines of the CPU build of vLLM, both built here: one serving plain weights,
which gets every weight with the adapter merged in (``VLLMGenerator.load_named_weights(full_weights(model))``, the
only path before), and one serving adapters (``adapter_engine_args``), which gets the adapter alone
(``VLLMGenerator.load_adapter``: written to a folder and loaded in place of the previous one). Then the same merged
weights go to a ``vllm serve`` process started here (``VLLMServerGenerator.load_full_weights``: generation paused,
packed buckets broadcast over gloo to the ``trajlab_gloo`` backend, prefix cache dropped, generation resumed).
Printed: the median seconds of ``--reps`` syncs after one warm-up, and the bytes each moves.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch
from _sync_models import sync_models
from peft import LoraConfig, get_peft_model

from trajlab.inference.vllm import VLLMGenerator, _saved_dtype, adapter_engine_args
from trajlab.inference.vllm_server import VLLMServerGenerator
from trajlab.inference.weights import full_weights
from trajlab.models.loading import load_model


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
    full_bytes = sum(t.numel() * t.element_size() for t in dict(full_weights(model)).values())
    plain = VLLMGenerator(model_dir, max_batch_size=4)
    full_s = median_seconds(lambda: plain.load_named_weights(full_weights(model)), reps)
    plain.llm.llm_engine.engine_core.shutdown()
    served = VLLMGenerator(model_dir, max_batch_size=4, engine_args=adapter_engine_args(rank))
    adapter_s = median_seconds(lambda: served.load_adapter(model), reps)
    served.llm.llm_engine.engine_core.shutdown()
    with vllm_server(model_dir) as url:
        remote = VLLMServerGenerator(url, "policy", None, adapter_dir=tempfile.gettempdir())
        server_s = median_seconds(lambda: remote.load_full_weights(model), reps)
    return {"full_s": full_s, "adapter_s": adapter_s, "server_s": server_s, "full_mb": full_bytes / 1e6,
            "adapter_mb": adapter_bytes / 1e6}


class vllm_server:  # noqa: N801 - used as a context manager, like open()
    """``vllm serve`` of ``model_dir`` taking full weights over gloo, on a free loopback port; its API root."""

    def __init__(self, model_dir: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                        "--served-model-name", "policy", "--port", str(self.port), "--host", "127.0.0.1",
                        "--dtype", _saved_dtype(model_dir), "--enforce-eager", "--logprobs-mode",
                        "processed_logprobs", "--weight-transfer-config", '{"backend": "trajlab_gloo"}']

    def __enter__(self) -> str:
        env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        url, deadline = f"http://127.0.0.1:{self.port}/v1", time.monotonic() + 300
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2):
                    return url
            except OSError:
                time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"vllm serve did not start: {' '.join(self.command)}")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-vllm-weight-sync")
    args = parser.parse_args()
    models = sync_models(args.work)
    rows = {name: measure(path, args.rank, args.reps) for name, path in models.items()}
    print(f"LoRA rank {args.rank}, median of {args.reps} syncs after a warm-up")
    print("| model | full weights merged: MB | in-process copy s | to a server, gloo buckets s | adapter alone: MB "
          "| s | in-process full / adapter seconds |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['full_mb']:.1f} | {row['full_s']:.3f} | {row['server_s']:.3f} | "
              f"{row['adapter_mb']:.2f} | {row['adapter_s']:.3f} | {row['full_s'] / row['adapter_s']:.1f}x |")


if __name__ == "__main__":
    main()
