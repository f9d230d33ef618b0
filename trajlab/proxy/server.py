"""Load a model directory into a running server: the wiring behind ``trajlab serve``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from transformers import AutoConfig, PreTrainedTokenizerBase

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat_template
from trajlab.inference.base import Generator, is_server_url
from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model, load_processor, load_tokenizer
from trajlab.proxy.app import ServeLimits, create_app
from trajlab.proxy.recording import SessionRecorder
from trajlab.proxy.upstream import UpstreamBackend, create_upstream_app


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``trajlab serve`` needs besides host and port."""

    model: Path | None = None
    upstream: str | None = None
    """An OpenAI base URL to forward to instead of loading ``model`` (exactly one of the two)."""
    served_model_name: str | None = None
    record_dir: Path = Path("runs/serve/sessions")
    parser: str = "auto"
    max_batch_size: int = 32
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0
    prefix_cache_bytes: int = 1 << 30
    """The hf generator's memory for key/value states kept between a session's calls (least recently used dropped
    first): with the model's weights, what bounds the server's memory."""
    device: str = "auto"
    """``model.device`` and ``model.dtype`` (see :func:`trajlab.models.loading.load_model`)."""
    dtype: str = "auto"
    backend: str = "hf"
    """What generates: hf (transformers on ``device``) or vllm (an in-process vLLM engine on its own platform)."""


def build_app(config: ServeConfig) -> FastAPI:
    """Load tokenizer, chat template, parser and model; one generator (``model.backend``: hf or vllm) serves every
    request. A vision-language model served with hf also gets its processor, so chat requests may hold images.

    With ``upstream`` set nothing is loaded: calls are forwarded there and recorded (``proxy.upstream``).

    Raises:
        FileNotFoundError / OSError: the model directory cannot be loaded.
        ValueError: unknown parser, or a chat template that rewrites history (``TemplateNotPrefixPreservingError``);
            both or neither of ``model`` and ``upstream``.
    """
    if (config.model is None) == (config.upstream is None):
        raise ValueError("give exactly one of --model (serve a model directory) and --upstream (forward to a server)")
    if config.upstream is not None:
        if not is_server_url(config.upstream):
            raise ValueError(f"--upstream must be an http(s) URL such as http://127.0.0.1:8001/v1, not "
                             f"{config.upstream!r}")
        limits = ServeLimits(max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s)
        return create_upstream_app(UpstreamBackend(config.upstream), SessionRecorder(config.record_dir), limits)
    tokenizer = load_tokenizer(config.model)
    template = resolve_chat_template(tokenizer)
    parser = get_parser(config.parser, tokenizer)
    name = config.served_model_name or Path(config.model).resolve().name
    processor = load_processor(config.model) if config.backend == "hf" else None  # vllm gets no images from us
    generator, model_config = _generator(config, tokenizer, name, processor)
    text_config = model_config.get_text_config()  # a vision-language model's context is its text model's
    context = int(getattr(text_config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    limits = ServeLimits(max_body_bytes=config.max_body_bytes, max_context=context,
                         body_timeout_s=config.body_timeout_s)
    return create_app(generator, tokenizer, template, parser, name, SessionRecorder(config.record_dir), limits,
                      processor)


def _generator(config: ServeConfig, tokenizer: PreTrainedTokenizerBase, name: str,
               processor: Any) -> tuple[Generator, Any]:
    """The model directory on the chosen backend, and its config (for the context length)."""
    if config.backend == "vllm":
        from trajlab.inference.vllm import VLLMGenerator

        generator = VLLMGenerator(config.model, max_batch_size=config.max_batch_size, name=name,
                                  engine_args=None if config.dtype == "auto" else {"dtype": config.dtype})
        return generator, AutoConfig.from_pretrained(config.model, local_files_only=True)
    model = load_model(config.model, device=config.device, dtype=config.dtype)
    return HFGenerator(model, tokenizer, max_batch_size=config.max_batch_size, name=name,
                       prefix_cache_bytes=config.prefix_cache_bytes, processor=processor), model.config
