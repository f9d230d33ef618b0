"""Refusing what cannot be served before paying for it, and handing freed memory back after a call.

Tokenizing is the costliest step of refusing a prompt that is too long: a fast tokenizer holds about 200 bytes per
token while it works (offsets, token strings), so the 4 MiB a body may hold became 2.7 million tokens, half a
gigabyte and 13 s of the event loop, only to be answered ``context_length_exceeded``. :class:`TokenFloor` bounds a
text's token count from its bytes alone, so such a prompt is refused in microseconds.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase


class TokenFloor:
    """The fewest tokens a text can take: its bytes (normalized as the tokenizer normalizes them) over the most bytes
    any one token spells. Exact for BPE tokenizers, where every token spells a piece of the normalized text and no
    token spells more than its vocabulary string holds; 0 (nothing refused) for any other kind of tokenizer, where a
    token may stand for more (WordPiece's ``[UNK]`` for a whole word, BPE's fused unknown tokens)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        model: Any = getattr(backend, "model", None)
        bpe = type(model).__name__ == "BPE" and not getattr(model, "fuse_unk", True)
        self.normalizer = backend.normalizer if bpe else None
        self.max_token_bytes = max(len(token.encode()) for token in tokenizer.get_vocab()) if bpe else None

    def __call__(self, text: str) -> int:
        if self.max_token_bytes is None:
            return 0
        if self.normalizer is not None:
            text = self.normalizer.normalize_str(text)
        return -(-len(text.encode()) // self.max_token_bytes)
