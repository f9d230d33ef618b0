"""The two models the weight-sync benchmarks hand around: the tiny offline model and a real-width 2-layer Qwen3-0.6B,
built once under a work folder and reused."""

from __future__ import annotations

from pathlib import Path

from trajlab.models.archs import init_arch_model
from trajlab.models.tiny import init_tiny_model


def sync_models(work: Path) -> dict[str, Path]:
    """Each model's name in the tables and its directory under ``work``, built where missing."""
    models = {"tiny": work / "tiny", "qwen3-0.6b, 2 layers": work / "qwen3-0.6b-2l"}
    if not (models["tiny"] / "config.json").is_file():
        init_tiny_model(models["tiny"], seed=0)
    if not (models["qwen3-0.6b, 2 layers"] / "config.json").is_file():
        init_arch_model("qwen3-0.6b", models["qwen3-0.6b, 2 layers"], layers=2, seed=0)
    return models
