"""Shared fixtures: the real tiny offline model, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from trajlab.chat.template import resolve_chat_template
from trajlab.models.loading import load_tokenizer
from trajlab.models.tiny import init_tiny_model


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
