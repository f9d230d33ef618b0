"""Batches whose rows resume from kept key/value states, for transformers models.

A row is laid out as ``[pad][known prefix][pad][tokens to feed]`` followed by the generated tokens: known prefixes
right-aligned in the first ``cached_width`` columns, the tokens still to feed right-aligned up to ``width``. Gaps
are masked padding; position ids follow the attention mask, so every token keeps the position it has in its own
sequence and reused states mean the same as freshly computed ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from trajlab.inference.prefix_cache import CachedPrefix


@dataclass(frozen=True)
class BatchLayout:
    cached: tuple[int, ...]
    cached_width: int
    width: int

    @classmethod
    def of(cls, sequences: Sequence[Sequence[int]], prefixes: Sequence[CachedPrefix | None]) -> BatchLayout:
        cached = tuple(prefix_length(p) for p in prefixes)
        fed = max(len(s) - c for s, c in zip(sequences, cached, strict=True))
        return cls(cached, max(cached), max(cached) + fed)

    def inputs(self, sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, width) input ids and attention mask; the known prefixes' ids are there only for the record."""
        input_ids = torch.full((len(sequences), self.width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, sequence in enumerate(sequences):
            cached, fed = self.cached[row], len(sequence) - self.cached[row]
            for columns, ids in ((slice(self.cached_width - cached, self.cached_width), sequence[:cached]),
                                 (slice(self.width - fed, self.width), sequence[cached:])):
                input_ids[row, columns] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, columns] = 1
        return input_ids, attention_mask

    def columns(self, row: int, length: int, generated: int = 0) -> list[int]:
        """Cache columns holding a row's sequence of ``length`` tokens and the first ``generated`` tokens after it."""
        fed = length - self.cached[row]
        return [*range(self.cached_width - self.cached[row], self.cached_width),
                *range(self.width - fed, self.width), *range(self.width, self.width + generated)]


class RoomyLayer(DynamicLayer):
    """A cache layer with room for the tokens to come. ``DynamicLayer`` appends by concatenating, which copies the
    whole cache at every decoding step and dominates decoding on a CPU; this one writes new tokens in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.length = keys.shape[2]
        shape = (*keys.shape[:2], self.length + room, keys.shape[3])
        self._keys, self._values = keys.new_empty(shape), values.new_empty(shape)
        self._keys[:, :, : self.length], self._values[:, :, : self.length] = keys, values
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[2]
        if end > self._keys.shape[2]:  # out of room: grow by doubling
            shape = (*self._keys.shape[:2], max(end, 2 * self._keys.shape[2]), self._keys.shape[3])
            keys, values = self._keys.new_empty(shape), self._values.new_empty(shape)
            keys[:, :, : self.length], values[:, :, : self.length] = self.keys, self.values
            self._keys, self._values = keys, values
        self._keys[:, :, self.length : end], self._values[:, :, self.length : end] = key_states, value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` only: the room of the others is freed with them."""
        self._keys, self._values = self._keys[indices], self._values[indices]
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]


def batch_cache(model: PreTrainedModel, prefixes: Sequence[CachedPrefix | None], layout: BatchLayout,
                room: int) -> DynamicCache | None:
    """The prefixes' states as one left-padded (B, kv_heads, cached_width, head_dim) cache per layer, with ``room``
    columns to grow into; None when no row has a known prefix."""
    template = next((p.layers for p in prefixes if p is not None), None)
    if template is None:
        return None
    width = layout.cached_width
    layers = []
    for index, (keys, _) in enumerate(template):
        shape = (len(prefixes), keys.shape[0], width, keys.shape[2])
        batch_keys, batch_values = keys.new_zeros(shape), keys.new_zeros(shape)
        for row, prefix in enumerate(prefixes):
            if prefix is not None:
                row_keys, row_values = prefix.layers[index]
                batch_keys[row, :, width - row_keys.shape[1]:] = row_keys
                batch_values[row, :, width - row_values.shape[1]:] = row_values
        layers.append(RoomyLayer(batch_keys, batch_values, room))
    cache = DynamicCache(config=model.config)
    cache.layers = layers
    return cache


def row_states(cache: DynamicCache, row: int, columns: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One row's keys and values at the given columns, copied out of the batch."""
    index = torch.tensor(columns, device=cache.layers[0].keys.device)
    return [(layer.keys[row].index_select(1, index), layer.values[row].index_select(1, index))
            for layer in cache.layers]


def prefix_length(prefix: CachedPrefix | None) -> int:
    return 0 if prefix is None else len(prefix.token_ids)


def weights_version(model: PreTrainedModel) -> tuple[int, ...]:
    """Bumped by every in-place change of a parameter (an optimizer step, ``load_state_dict``)."""
    return tuple(p._version for p in model.parameters())


def supports_prefix_reuse(model: PreTrainedModel) -> bool:
    """Only full-attention key/value caches can be cut per row and padded back together."""
    if model.config.is_encoder_decoder:
        return False
    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
