"""vLLM's side of :mod:`trajlab.inference.weight_broadcast`: a weight transfer engine for vLLM's RL weight-update
protocol (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``),
receiving the trainer's packed buckets over gloo.

vLLM's own engines for that protocol (NCCL, CUDA IPC) need GPUs; this one runs wherever gloo does, the CPU build
included. It is registered under the backend name ``trajlab_gloo`` by trajlab's vLLM plugin
(:mod:`trajlab.inference.vllm_plugin`), so a server started with
``--weight-transfer-config '{"backend": "trajlab_gloo"}'`` takes weights from trajlab's trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from trajlab.inference import weight_broadcast


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer serves the rendezvous, the first engine rank, and the group's size (trainer included)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: :func:`trajlab.inference.weight_broadcast.describe` of the weights about to be broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buckets: list[int] = field(default_factory=list)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives checkpoint-format weights in buckets and loads them with vLLM's layerwise reload, as its NCCL
    engine does."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.group = weight_broadcast.open_group(init_info.master_address, init_info.master_port, rank,
                                                 init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As the base class, but synchronising the accelerator only where there is one (the CPU build has none)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("trajlab_gloo weight transfer not initialised: call init_weight_transfer_engine first")
        description = {"names": update_info.names, "dtype_names": update_info.dtype_names,
                       "shapes": update_info.shapes, "buckets": update_info.buckets}
        weight_broadcast.receive(self.group, description, self.model.load_weights)

    def shutdown(self) -> None:
        self.group = None
