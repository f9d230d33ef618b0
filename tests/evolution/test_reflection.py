"""The reflection LM from an OpenAI-compatible server: ``trajlab serve``'s real app with the tiny model."""

from __future__ import annotations

import threading
import time

import pytest

import trajlab
from tests.evolution.scripted import INSTRUCTED
from tests.inference.loopback import JSONHandler, serving
from tests.proxy.conftest import MODEL, running
from trajlab.chat.parsers import get_parser
from trajlab.config import EvolveSettings, ModelSettings, ServeSettings
from trajlab.evolution.reflection import ServerReflection, load_reflection_lm
from trajlab.evolution.search import LOG_FILE, rollouts_path
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
        reflection = load_reflection_lm(f"{url}/v1#{MODEL}", settings=SHORT, model=ModelSettings(),
                                        server_timeout_s=60)
        assert isinstance(reflection, ServerReflection) and reflection.model == MODEL
        assert isinstance(reflection("Write a better instruction in a ``` block."), str)
        with pytest.raises(ValueError, match="does not serve"):
            load_reflection_lm(f"{url}/v1#no-such-model", settings=SHORT, model=ModelSettings(),
                               server_timeout_s=60)


def test_a_bad_reflection_spec_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="a model directory, a Hugging Face model name or a server URL .*: cannot "
                                         "load the reflection LM: '.*/missing' does not exist"):
        load_reflection_lm(str(tmp_path / "missing"), settings=SHORT, model=ModelSettings(), server_timeout_s=60)


class _Silent(JSONHandler):
    """A reflection server that lists its model, then never answers a chat completion (for 10 s: then it hangs up)."""

    released = threading.Event()

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.answer(200, {"object": "list", "data": [{"id": "silent", "object": "model"}]})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.released.wait(10)


def test_a_silent_reflection_server_fails_each_proposal_within_rollout_server_timeout_s(tmp_path):
    """The reflection call's timeout was 600 s, whatever the run said: a stuck server held each iteration that long."""
    handler = type("Handler", (_Silent,), {"released": threading.Event()})
    out = tmp_path / "evolve"
    with serving(handler) as server:
        started = time.monotonic()
        try:
            trajlab.evolve(INSTRUCTED, "oracle", out, reflection=f"http://127.0.0.1:{server.server_port}/v1#silent",
                           rollout={"server_timeout_s": 1}, train_tasks=3, val_tasks=2, max_metric_calls=8)
        finally:
            handler.released.set()
        elapsed = time.monotonic() - started
    log = (rollouts_path(out).parent / LOG_FILE).read_text()
    assert "(the reflection LM) did not answer within 1 s (rollout.server_timeout_s)" in log, log[-2000:]
    assert elapsed < 20
