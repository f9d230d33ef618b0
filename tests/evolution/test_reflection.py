"""The reflection LM from an OpenAI-compatible server: ``trajlab serve``'s real app with the tiny model."""

from __future__ import annotations

import pytest

from tests.proxy.conftest import MODEL, running
from trajlab.chat.parsers import get_parser
from trajlab.config import EvolveSettings, ModelSettings, ServeSettings
from trajlab.evolution.reflection import ServerReflection, load_reflection_lm
from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model
from trajlab.proxy import SessionRecorder, create_app

SHORT = EvolveSettings(reflection_max_new_tokens=8)


def test_a_server_reflects_through_chat_completions(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path):
    app = create_app(HFGenerator(load_model(tiny_model_dir), tiny_tokenizer, max_batch_size=32), tiny_tokenizer,
                     tiny_template,
                     get_parser("auto", tiny_tokenizer), MODEL, SessionRecorder(tmp_path), ServeSettings(),
                     tiny_tokenizer.model_max_length)
    with running(app) as url:
        reflection = load_reflection_lm(f"{url}/v1#{MODEL}", settings=SHORT, model=ModelSettings())
        assert isinstance(reflection, ServerReflection) and reflection.model == MODEL
        assert isinstance(reflection("Write a better instruction in a ``` block."), str)
        with pytest.raises(ValueError, match="does not serve"):
            load_reflection_lm(f"{url}/v1#no-such-model", settings=SHORT, model=ModelSettings())


def test_a_bad_reflection_spec_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="a model directory, a Hugging Face model name or a server URL .*: cannot "
                                         "load the reflection LM: '.*/missing' does not exist"):
        load_reflection_lm(str(tmp_path / "missing"), settings=SHORT, model=ModelSettings())
