"""Text of token ids where a token boundary falls inside a UTF-8 character.

A byte-level BPE model writes bytes: a CJK character or an emoji often takes several tokens, and a reply can end
(at its stop token or its token limit) after only some of a character's bytes. ``tokenizer.decode`` shows those
bytes as U+FFFD, a character the model never wrote; a client that sends the text back sends that U+FFFD.
:func:`shown_text` is the text as the recording server shows it: ``decode``, except that an incomplete character
at the end of a run of text tokens (at the end, or before a special or added token) is left out rather than
replaced, as a streaming detokenizer holds back bytes until their character completes. Bytes that can never form
a character (an invalid sequence inside the text) stay U+FFFD, as ``decode`` writes them.
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence
from itertools import groupby

from transformers import PreTrainedTokenizerBase


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme): printable Latin-1 bytes stand for
    themselves, the others for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


BYTE_OF_CHAR = _byte_alphabet()
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _ByteView:
    """The bytes of one byte-level tokenizer's tokens; special and added tokens are boundaries of text runs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.added = frozenset(tokenizer.added_tokens_decoder)

    def run_bytes(self, ids: list[int]) -> bytes | None:
        """The bytes of a run of text tokens, or None when a token is not written in the byte alphabet."""
        out = bytearray()
        for token in self.tokenizer.convert_ids_to_tokens(ids):
            if token is None or any(char not in BYTE_OF_CHAR for char in token):
                return None
            out.extend(BYTE_OF_CHAR[char] for char in token)
        return bytes(out)


def _view(tokenizer: PreTrainedTokenizerBase) -> _ByteView:
    view = _VIEWS.get(tokenizer)
    if view is None:
        view = _VIEWS[tokenizer] = _ByteView(tokenizer)
    return view


def complete_prefix(data: bytes) -> tuple[str, int]:
    """``data`` decoded up to an incomplete character at its end, and how many bytes that character has so far."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data, final=False)
    return text, len(decoder.getstate()[0])


def token_bytes(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[bytes]:
    """Each token's own bytes (a piece of a character for a token that holds only part of one), as OpenAI's
    logprobs report them so that a client can join a character's pieces; a token this module cannot read as bytes
    gives its decoded text's."""
    view = _view(tokenizer)
    out = []
    for token in ids:
        data = None if token in view.added else view.run_bytes([token])
        out.append(data if data is not None else tokenizer.decode([token], skip_special_tokens=False).encode())
    return out


def shown_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """``decode(ids)`` without an incomplete character ending a run of text tokens (see the module docstring).

    Only where this module's reading of the tokens as bytes gives exactly ``decode``'s text (byte-level BPE
    tokenizers); any other tokenizer's text is ``decode``'s own.
    """
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    view = _view(tokenizer)
    whole, shown = [], []
    for added, group in groupby(ids, key=view.added.__contains__):
        run = list(group)
        if added:
            piece = tokenizer.decode(run, skip_special_tokens=False)
            whole.append(piece)
            shown.append(piece)
            continue
        data = view.run_bytes(run)
        if data is None:
            return text
        whole.append(data.decode("utf-8", "replace"))
        shown.append(complete_prefix(data)[0])
    return "".join(shown) if "".join(whole) == text else text
