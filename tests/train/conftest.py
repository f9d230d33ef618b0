"""Fixtures of the training tests."""

from __future__ import annotations

import pytest

from trajlab.models.tiny import init_tiny_model


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory):
    """A second tiny model (other weights, same tokenizer): a sampler that is not the trainer."""
    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed1", seed=1)
