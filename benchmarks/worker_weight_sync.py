"""Weight sync to Ray rollout workers: the broadcast over a gloo group against Ray's object store (the path before).

    python benchmarks/worker_weight_sync.py      # the tiny model, then a real-width 2-layer Qwen3-0.6B; 2 workers

Per model, one local Ray cluster with ``--workers`` rollout workers (``RayRolloutRunner`` over the model directory,
the ``hf`` backend on the CPU), and the same trained weights (the model with every weight moved) handed to them both
ways in one run, alternating: ``RayRolloutRunner.load_weights`` (a host copy, then packed buckets broadcast once to
every worker, each loading them), and the path it replaced (the host copy put in Ray's object store once, every
worker getting it and loading it: ``ray.put`` then ``RolloutWorker.load_weights``). Printed: the median seconds of
``--reps`` syncs of each after one warm-up of each, and the bytes the trainer sends.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ray
import torch
from _sync_models import sync_models

from trajlab.collection.workers import RayRolloutRunner, WorkerSpec
from trajlab.config import ModelSettings, RolloutSettings
from trajlab.env import load_env
from trajlab.inference.weights import full_weights
from trajlab.models.loading import load_model


def object_store_sync(runner: RayRolloutRunner, model: torch.nn.Module) -> None:
    """The path before: the weights put in Ray's object store once, every worker getting and loading them."""
    weights = ray.put({name: tensor.detach().to("cpu", copy=True) for name, tensor in full_weights(model)})
    ray.get([worker.load_weights.remote(weights) for worker in runner.workers])


def timed(sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    sync()
    return time.perf_counter() - start


def measure(model_dir: Path, workers: int, reps: int) -> dict[str, float]:
    model = load_model(model_dir)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    spec = WorkerSpec(env=load_env("arithmetic"), policy=str(model_dir), tokenizer=None,
                      model=ModelSettings(device="cpu"), rollout=RolloutSettings(workers=workers),
                      temperature=1.0, seed=0)
    runner = RayRolloutRunner(spec, run_dir=None, worker_cpus=0)
    try:
        sides = {"broadcast": lambda: runner.load_weights(model), "object_store": lambda: object_store_sync(runner,
                                                                                                           model)}
        for sync in sides.values():
            sync()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(reps):
            for name, sync in sides.items():
                times[name].append(timed(sync))
    finally:
        runner.close()
    size = sum(t.numel() * t.element_size() for t in dict(full_weights(model)).values())
    return {"mb": size / 1e6, **{f"{name}_s": statistics.median(values) for name, values in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-worker-weight-sync")
    args = parser.parse_args()
    models = sync_models(args.work)
    rows = {name: measure(path, args.workers, args.reps) for name, path in models.items()}
    print(f"{args.workers} workers, median of {args.reps} syncs of each after a warm-up of each, alternating")
    print("| model | weights MB | object store s | broadcast s | object store / broadcast |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['mb']:.1f} | {row['object_store_s']:.3f} | {row['broadcast_s']:.3f} | "
              f"{row['object_store_s'] / row['broadcast_s']:.2f}x |")


if __name__ == "__main__":
    main()
