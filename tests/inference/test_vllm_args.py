"""What reaches ``vllm.LLM(...)`` from the config's ``model`` section, for every way a vLLM engine is started.

vLLM is not installed in the main venv (its lane, tests/vllm, runs it for real on its CPU build), so a stand-in
``vllm`` module records the engine's keyword arguments; everything between the config and that call is trajlab's own.
"""

import sys
import time
import types

import pytest

from tests.inference.loopback import JSONHandler, serving
from trajlab.collection.engines import load_rollout_policy
from trajlab.config import ModelSettings, RolloutSettings, ServeSettings, load_config
from trajlab.env import load_env
from trajlab.errors import UserError
from trajlab.proxy.server import build_app
from trajlab.recipes.rl import _vllm_sampler

SECTION = {"backend": "vllm", "dtype": "bfloat16",
           "vllm": {"gpu_memory_utilization": 0.35, "max_model_len": 8192, "enforce_eager": False}}
EXPECTED = {"gpu_memory_utilization": 0.35, "max_model_len": 8192, "enforce_eager": False, "dtype": "bfloat16"}


@pytest.fixture
def engines(monkeypatch):
    """A stand-in ``vllm`` package whose ``LLM`` records its keyword arguments, one dict per engine started."""
    started: list[dict] = []

    class LLM:
        def __init__(self, **kwargs):
            started.append(kwargs)
            self.llm_engine = types.SimpleNamespace()  # what continuous batching steps

    platform = types.SimpleNamespace(is_cpu=lambda: True, is_sleep_mode_available=lambda: False)
    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = platform
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return started


def _checked(started: list[dict], model_dir) -> None:
    assert len(started) == 1
    args = started[0]
    assert {key: args[key] for key in EXPECTED} == EXPECTED
    assert args["model"] == str(model_dir) and args["skip_tokenizer_init"] is True
    assert args["logprobs_mode"] == "processed_logprobs"


def test_collect_and_eval_engines_get_the_model_section(engines, tiny_model_dir):
    model = load_config(None, {"model": SECTION}).model
    load_rollout_policy(load_env("arithmetic"), str(tiny_model_dir), model=model,
                        rollout=RolloutSettings(concurrency=4), tokenizer=None, demonstrator=None)
    _checked(engines, tiny_model_dir)


def test_the_rl_sampler_gets_the_model_section(engines, tiny_model_dir, tmp_path):
    _vllm_sampler(str(tiny_model_dir), ModelSettings.model_validate(SECTION), RolloutSettings(), seed=3,
                  lora_rank=None, tokenizer=None, out=tmp_path)
    _checked(engines, tiny_model_dir)
    assert engines[0]["seed"] == 3 and "enable_lora" not in engines[0]


def test_with_lora_the_rl_engine_serves_the_adapter(engines, tiny_model_dir, tmp_path):
    generator = _vllm_sampler(str(tiny_model_dir), ModelSettings.model_validate(SECTION), RolloutSettings(), seed=3,
                              lora_rank=12, tokenizer=None, out=tmp_path)
    _checked(engines, tiny_model_dir)
    assert {key: engines[0][key] for key in ("enable_lora", "max_loras", "max_lora_rank")} == {
        "enable_lora": True, "max_loras": 1, "max_lora_rank": 16}, "the smallest rank vLLM takes that holds 12"
    assert generator.serves_adapters


def test_an_external_server_that_cannot_be_reached_is_refused_before_any_engine(engines, tiny_model_dir, tmp_path):
    section = SECTION | {"vllm": {"server": "http://127.0.0.1:9/v1"}}
    with pytest.raises(UserError, match=r"model.vllm.server: cannot reach an OpenAI-compatible server"):
        _vllm_sampler(str(tiny_model_dir), ModelSettings.model_validate(section), RolloutSettings(), seed=0,
                      lora_rank=None, tokenizer=None, out=tmp_path)
    assert not engines


class _NoWeightTransfer(JSONHandler):
    """An OpenAI-compatible server that lists a model and has none of vLLM's weight-transfer endpoints."""

    answers = {"/v1/models": {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0,
                                                          "owned_by": "test"}]}}

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path in self.answers:
            self.answer(200, self.answers[self.path])
        else:
            self.send_error(404)

    def do_POST(self):  # noqa: N802
        self.send_error(400, "Weight transfer not configured")


class _RefusesWeightTransfer(_NoWeightTransfer):
    """Has vLLM's world-size endpoint (development mode) but refuses to start a weight transfer (no backend)."""

    answers = _NoWeightTransfer.answers | {"/get_world_size": {"world_size": 1}}


@pytest.mark.parametrize(("handler", "refusal"), [(_NoWeightTransfer, "get_world_size answered HTTP 404"),
                                                  (_RefusesWeightTransfer, "init_weight_transfer_engine answered "
                                                                           "HTTP 400")])
def test_without_lora_a_server_that_cannot_take_weights_is_refused_before_any_step(engines, tiny_model_dir, tmp_path,
                                                                                   handler, refusal):
    """At once: the trainer does not wait out the transfer group's rendezvous for a server that refused to join."""
    started = time.monotonic()
    with serving(handler) as server:
        section = SECTION | {"vllm": {"server": f"http://127.0.0.1:{server.server_port}/v1"}}
        with pytest.raises(UserError, match=rf"(?s)cannot take full weights: .*{refusal}.*"
                                            r"trajlab_gloo.*VLLM_SERVER_DEV_MODE=1.*Or train with rl.lora"):
            _vllm_sampler(str(tiny_model_dir), ModelSettings.model_validate(section), RolloutSettings(), seed=0,
                          lora_rank=None, tokenizer=None, out=tmp_path)
    assert time.monotonic() - started < 30 and not engines


def test_serve_gets_the_model_section(engines, tiny_model_dir):
    build_app(ServeSettings(), ModelSettings.model_validate(SECTION | {"path": str(tiny_model_dir)}), "auto")
    _checked(engines, tiny_model_dir)


def test_defaults_keep_the_eager_engine_in_the_checkpoints_dtype(engines, tiny_model_dir, tmp_path):
    _vllm_sampler(str(tiny_model_dir), ModelSettings(backend="vllm"), RolloutSettings(), seed=0, lora_rank=None,
                  tokenizer=None, out=tmp_path)
    args = engines[0]
    assert args["enforce_eager"] is True and args["dtype"] == "float32"
    assert "gpu_memory_utilization" not in args and "max_model_len" not in args, "vLLM's own defaults"
