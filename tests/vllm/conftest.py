"""Fixtures of the vLLM lane's modules."""

from __future__ import annotations

import pytest

QUESTIONS = ["hi", "what is 2 + 3?", "add 4 and 5, then multiply by 2"]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    """Three user questions as the tiny model's chat template renders them, generation prompt included, in ids."""
    rendered = [tiny_tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                   add_generation_prompt=True) for q in QUESTIONS]
    return [tiny_tokenizer.encode(text, add_special_tokens=False) for text in rendered]
