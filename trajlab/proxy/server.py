"""Load a model directory into a running server: the wiring behind ``trajlab serve``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from transformers import AutoConfig, PreTrainedTokenizerBase

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat
from trajlab.config import ModelSettings, ServeSettings
from trajlab.inference.base import Generator, is_server_url
from trajlab.inference.hf import HFGenerator
from trajlab.inference.prefix_cache import default_budget
from trajlab.models.hub import resolve_model_dir
from trajlab.models.loading import load_model, load_processor, load_tokenizer
from trajlab.proxy.local import create_app
from trajlab.proxy.recording import SessionRecorder
from trajlab.proxy.upstream import UpstreamBackend, create_upstream_app


def build_app(serve: ServeSettings, model: ModelSettings, parser: str) -> FastAPI:
    """Load tokenizer, chat template, parser and model; one generator (``model.backend``: hf or vllm) serves every
    request. A vision-language model served with hf also gets its processor, so chat requests may hold images.

    With ``serve.upstream`` set nothing is loaded and ``model`` and ``parser`` are not read: calls are forwarded
    there and recorded (``proxy.upstream``).

    Args:
        serve: the server's settings (the config's ``serve`` section).
        model: what to serve: ``path``, loaded on ``device`` in ``dtype`` by ``backend``.
        parser: the tool-call parser's name (``rollout.parser``).

    Raises:
        FileNotFoundError / OSError: the model directory cannot be loaded.
        ValueError: no ``model.path`` and no ``serve.upstream``; an upstream that is no http(s) URL; an unknown
            parser; a ``serve.max_context`` longer than the model's.
    """
    if serve.upstream is not None:
        if not is_server_url(serve.upstream):
            raise ValueError(f"--upstream (serve.upstream) must be an http(s) URL such as http://127.0.0.1:8001/v1, "
                             f"not {serve.upstream!r}")
        return create_upstream_app(UpstreamBackend(serve.upstream), SessionRecorder(serve.record_dir), serve)
    if model.path is None:
        raise ValueError("nothing to serve: give --model DIR (model.path) to serve a model directory, or --upstream "
                         "URL (serve.upstream) to forward to a server")
    given = model.path  # a directory, or a Hugging Face name: clients then call the model by that name
    name = serve.served_model_name or (Path(given).resolve().name if Path(given).is_dir() else given)
    model = model.model_copy(update={"path": str(resolve_model_dir(given))})
    tokenizer = load_tokenizer(model.path)
    template, context = resolve_chat(tokenizer, model.chat_template_kwargs)
    tool_parser = get_parser(parser, tokenizer)
    processor = load_processor(model.path) if model.backend == "hf" else None  # vllm gets no images from us
    generator, model_config = _generator(serve, model, tokenizer, name, processor)
    text_config = model_config.get_text_config()  # a vision-language model's context is its text model's
    model_context = int(getattr(text_config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    return create_app(generator, tokenizer, template, tool_parser, name, SessionRecorder(serve.record_dir), serve,
                      model_context, processor, context)


def _generator(serve: ServeSettings, model: ModelSettings, tokenizer: PreTrainedTokenizerBase, name: str,
               processor: Any) -> tuple[Generator, Any]:
    """The model directory on the chosen backend, and its config (for the context length)."""
    if model.backend == "vllm":
        from trajlab.inference.vllm import VLLMGenerator

        generator = VLLMGenerator(model.path, max_batch_size=serve.max_batch_size, name=name,
                                  engine_args=model.engine_args(), batching=model.vllm.batching)
        return generator, AutoConfig.from_pretrained(model.path, local_files_only=True)
    loaded = load_model(model.path, device=model.device, dtype=model.dtype)
    budget = default_budget(loaded) if serve.prefix_cache_mb is None else serve.prefix_cache_mb << 20
    return HFGenerator(loaded, tokenizer, max_batch_size=serve.max_batch_size, name=name, prefix_cache_bytes=budget,
                       processor=processor), loaded.config
