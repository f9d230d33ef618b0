"""Shared fixtures: the real tiny offline model, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trajlab.chat.template import resolve_chat_template
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.models.tiny import init_tiny_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The heaviest tests first, by their ``slow(seconds)`` marks: pytest-xdist's worksteal hands each worker a
    contiguous share of this order and an idle worker steals from the back of the other's queue, so heavy tests
    started first leave short ones for the end and the two workers finish together (in file order the twins and the
    GPU smoke came late, in one worker's share)."""
    def seconds(item: pytest.Item) -> float:
        mark = item.get_closest_marker("slow")
        return mark.args[0] if mark is not None and mark.args else 0.0

    items.sort(key=seconds, reverse=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_template(tiny_tokenizer) -> str:
    return resolve_chat_template(tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny offline vision-language model (Gemma 3 architecture), built once."""
    from trajlab.models.tiny_vision import init_tiny_vision_model

    return init_tiny_vision_model(tmp_path_factory.mktemp("models") / "tiny-vl", seed=0)


@pytest.fixture(scope="session")
def terse_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its next-token distribution flattened (the final norm's gain at 0.2: logits of std about
    0.3, near uniform over 1,536 tokens) and its end-of-turn logit raised to 6 above them, so its answers end after a
    few tokens, at lengths that differ from sample to sample (the untrained model's logits have a std of about 1.4,
    against which a logit of 6 does not stand out: its answers are mostly scored alike and its RL groups flat)."""
    model, tokenizer = load_model(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about rain."}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        model.model.norm.weight.mul_(0.2)
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.lm_head.weight[end] = hidden / hidden.norm() ** 2 * 6.0
    path = tmp_path_factory.mktemp("terse") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
