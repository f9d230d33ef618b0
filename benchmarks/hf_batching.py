"""Does continuous batching pay for the ``hf`` backend on a CPU? transformers' continuous batching
(``model.generate_batch``) against trajlab's ``hf`` backend and plain ``model.generate``, on one batch, at Qwen3-0.6B's
real widths.

    python benchmarks/hf_batching.py            # 2 layers, 8 prompts x 64 tokens, 32 new tokens each

The measurement is the GPU run's ``rollouts`` (``benchmarks/gpu/rollouts.py``: each side in its own interpreter, one
warm-up batch, the median of 3, temperature 1, no early stops), here on the CPU with a randomly initialised Qwen3 of
Qwen3-0.6B's widths, ``--layers`` layers, float32, and the smoke run's 2,048-token vocabulary (the tiny offline
tokenizer's ids). Continuous batching's gain in multi-turn RL is that no episode waits for a batch's slowest turn;
it pays only if that gain outweighs what it costs a batch, which is what this measures (the gain itself, measured
with vLLM on the same machine, is in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import rollouts  # noqa: E402
from common import SHAPE_KEYS, Scale  # noqa: E402

from trajlab.models.archs import ARCHS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="new tokens a row")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-hf-batching")
    args = parser.parse_args()
    shape = {key: ARCHS["qwen3-0.6b"].config[key] for key in SHAPE_KEYS} | {"num_hidden_layers": args.layers}
    scale = dataclasses.replace(Scale.for_smoke(), arch=f"qwen3-0.6b-widths-{args.layers}l", shape=shape,
                                rollout_batch=args.batch, rollout_prompt=args.prompt, max_new_tokens=args.new)
    args.work.mkdir(parents=True, exist_ok=True)
    print(rollouts.table(rollouts.measure(scale, args.work)))


if __name__ == "__main__":
    main()
