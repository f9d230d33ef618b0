"""trajlab's vLLM plugin (entry point group ``vllm.general_plugins``, loaded by every vLLM process): registers the
``trajlab_gloo`` weight transfer backend, so a ``vllm serve`` started with
``--weight-transfer-config '{"backend": "trajlab_gloo"}'`` takes full weights from trajlab's trainer over gloo."""

from __future__ import annotations

import contextlib

BACKEND = "trajlab_gloo"


def register() -> None:
    """Register the backend by module path: nothing of trajlab is imported until a server uses it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already: plugins may be loaded more than once in a process
        WeightTransferEngineFactory.register_engine(BACKEND, "trajlab.inference.vllm_weight_engine",
                                                    "GlooWeightTransferEngine")
