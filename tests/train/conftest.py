"""Fixtures of the training tests."""

from __future__ import annotations

import pytest
import torch

from trajlab.models import load_model, load_tokenizer


@pytest.fixture(scope="session")
def terse_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its end-of-turn logit raised (about 6 above the others' near-zero logits), so its answers
    end after a few tokens, at lengths that differ from sample to sample (the untrained model almost never stops:
    its distribution is near uniform over 1,536 tokens)."""
    model, tokenizer = load_model(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about rain."}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.lm_head.weight[end] = hidden / hidden.norm() ** 2 * 6.0
    path = tmp_path_factory.mktemp("terse") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
