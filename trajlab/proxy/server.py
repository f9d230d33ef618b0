"""Load a model directory into a running server: the wiring behind ``trajlab serve``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat_template
from trajlab.inference.hf import HFGenerator
from trajlab.models import load_model, load_tokenizer
from trajlab.proxy.app import ServeLimits, create_app
from trajlab.proxy.recording import SessionRecorder


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``trajlab serve`` needs besides host and port."""

    model: Path
    served_model_name: str | None = None
    record_dir: Path = Path("runs/serve/sessions")
    parser: str = "auto"
    max_batch_size: int = 32
    max_body_bytes: int = 4 << 20
    device: str = "cpu"


def build_app(config: ServeConfig) -> FastAPI:
    """Load tokenizer, chat template, parser and model; one ``hf`` generator serves every request.

    Raises:
        FileNotFoundError / OSError: the model directory cannot be loaded.
        ValueError: unknown parser, or a chat template that rewrites history (``TemplateNotPrefixPreservingError``).
    """
    tokenizer = load_tokenizer(config.model)
    template = resolve_chat_template(tokenizer)
    parser = get_parser(config.parser, tokenizer)
    model = load_model(config.model, device=config.device)
    name = config.served_model_name or Path(config.model).resolve().name
    context = int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    generator = HFGenerator(model, tokenizer, max_batch_size=config.max_batch_size, name=name)
    limits = ServeLimits(max_body_bytes=config.max_body_bytes, max_context=context)
    return create_app(generator, tokenizer, template, parser, name, SessionRecorder(config.record_dir), limits)
