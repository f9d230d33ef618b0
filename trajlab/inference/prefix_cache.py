"""Key/value states of token prefixes the model has already read, so a later turn feeds only its new tokens.

An episode's next prompt is its previous prompt plus what the model generated plus the tool result: append-only
token ids. Keeping the attention keys and values of that history turns each turn's prefill from the whole
conversation into the few new tokens, and the system prompt and tool schemas that every episode shares are read
once per batch instead of once per episode.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LayerStates = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (keys, values) of one sequence, each shaped (kv_heads, tokens, head_dim)."""


@dataclass(frozen=True)
class CachedPrefix:
    token_ids: tuple[int, ...]
    layers: LayerStates

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


MIN_DEFAULT_BYTES = 64 << 20
"""The least a default budget holds: about 32,000 tokens' states on the tiny model."""


def default_budget(model: torch.nn.Module) -> int:
    """A quarter of ``model``'s weight bytes, at least ``MIN_DEFAULT_BYTES``: kept states then add at most a quarter
    to what the weights take, whatever the model's size."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(MIN_DEFAULT_BYTES, weights // 4)


class PrefixCache:
    """Least-recently-used store of prefix states, bounded in bytes.

    States are only valid for the weights that computed them: the owner calls ``clear`` when the weights change.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self._lengths: dict[int, int] = {}  # prefix length -> number of entries of that length
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, prompt_ids: Sequence[int]) -> CachedPrefix | None:
        """The longest stored prefix of ``prompt_ids`` that leaves at least one token to feed."""
        for length in sorted(self._lengths, reverse=True):
            if length >= len(prompt_ids):
                continue
            entry = self._entries.get(tuple(prompt_ids[:length]))
            if entry is not None:
                self._entries.move_to_end(entry.token_ids)
                self.hits += 1
                self.reused_tokens += length
                return entry
        return None

    def get(self, token_ids: tuple[int, ...]) -> CachedPrefix | None:
        entry = self._entries.get(token_ids)
        if entry is not None:
            self._entries.move_to_end(token_ids)
        return entry

    def add(self, entry: CachedPrefix) -> None:
        if not entry.token_ids or entry.nbytes > self.max_bytes:
            return
        self._remove(entry.token_ids)
        self._entries[entry.token_ids] = entry
        self._lengths[len(entry.token_ids)] = self._lengths.get(len(entry.token_ids), 0) + 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.nbytes = 0

    def _remove(self, token_ids: tuple[int, ...]) -> None:
        entry = self._entries.pop(token_ids, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes
        self._lengths[len(token_ids)] -= 1
        if not self._lengths[len(token_ids)]:
            del self._lengths[len(token_ids)]
