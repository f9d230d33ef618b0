"""A policy from what the user has: ``oracle``, a model directory, a server URL, a loaded model, or a Generator.

Every stage rolls out a :class:`Policy`: the generator plus the tokenizer and prefix-preserving chat template the
trajectories are written in. The command line passes strings; the Python API passes built objects too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trajlab.chat.context import TemplateContext
from trajlab.chat.template import resolve_chat
from trajlab.errors import UserError
from trajlab.inference.base import DEFAULT_BATCHING, DEFAULT_SERVER_TIMEOUT_S, Batching, Generator, is_server_url
from trajlab.models.devices import AUTO

PolicyLike = str | Path | Generator | PreTrainedModel
"""``"oracle"`` (the env's reference policy), a model directory or a Hugging Face name in the cache,
``http://host:port/v1[#model]``, a loaded transformers model, or any :class:`~trajlab.inference.base.Generator`."""


@dataclass(frozen=True)
class Policy:
    """A generator and the tokenizer and chat template its trajectories are written in (and, for a vision-language
    model, the processor that turns images into its tokens), and the variables and pinned date the template renders
    with (recorded with each trajectory)."""

    generator: Generator
    tokenizer: PreTrainedTokenizerBase
    chat_template: str
    processor: Any = None
    context: TemplateContext = field(default_factory=TemplateContext)


def load_policy(
    policy: PolicyLike | Policy,
    *,
    device: str,
    dtype: str,
    backend: str,
    max_batch_size: int,
    tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
    oracle: Any = None,
    vision: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    engine_args: dict[str, Any] | None = None,
    vllm_batching: Batching = DEFAULT_BATCHING,
    server_timeout_s: float = DEFAULT_SERVER_TIMEOUT_S,
) -> Policy:
    """Build the policy a user named.

    Args:
        policy: see :data:`PolicyLike`; a :class:`Policy` is returned as it is.
        tokenizer: the tokenizer (or its directory) trajectories are written in: optional for the oracle (default:
            the tiny offline model's), required for a server, a loaded model or a Generator.
        oracle: the env's reference policy, for ``"oracle"``.
        max_batch_size: the most turns a model's generator batches (``rollout.concurrency``: never more run).
        device, dtype: where a model directory is loaded, in what dtype (see :func:`trajlab.models.loading.load_model`);
            other policies are already placed.
        backend: what generates for a model directory: ``"hf"`` (transformers) or ``"vllm"`` (an in-process vLLM
            engine); the oracle, a server, a loaded model and a Generator bring their own.
        vision: the env shows images: the oracle's default tokenizer is then the tiny vision-language model's.
        template_kwargs: the chat template's variables (``model.chat_template_kwargs``, e.g. ``enable_thinking``).
        engine_args: the vllm backend's ``vllm.LLM`` arguments (``ModelSettings.engine_args``: the dtype unless
            auto, memory share, context length, eager); None: the checkpoint's dtype and the engine's defaults.
        vllm_batching: the vllm backend's ``continuous`` or ``lockstep`` batching (``model.vllm.batching``).
        server_timeout_s: the most one turn may take on a server policy (``rollout.server_timeout_s``).

    Raises:
        UserError: what is missing or wrong, and how to fix it.
    """
    from trajlab.inference.hf import HFGenerator

    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str | Path):
        spec = str(policy)
        if spec == "oracle":
            return oracle_policy(oracle, tokenizer, vision, template_kwargs)
        if is_server_url(spec):
            return _server_policy(spec, tokenizer, template_kwargs, server_timeout_s)
        spec = str(_model_dir(spec))
        loaded = _tokenizer(tokenizer or spec)
        processor = _processor(spec)
        generator = _model_generator(spec, loaded, processor, backend=backend, device=device, dtype=dtype,
                                     max_batch_size=max_batch_size, engine_args=engine_args, batching=vllm_batching)
        template, context = resolve_chat(loaded, template_kwargs)
        return Policy(generator, loaded, template, processor, context)
    if tokenizer is None:
        raise UserError(f"a {type(policy).__name__} policy needs tokenizer=: the tokenizer (or its directory) its "
                        "prompts are rendered and tool calls read in.")
    loaded = _tokenizer(tokenizer)
    if isinstance(policy, PreTrainedModel):
        built: Generator = HFGenerator(policy, loaded, max_batch_size=max_batch_size,
                                       name=str(policy.name_or_path or "model"))
    else:
        built = policy
    template, context = resolve_chat(loaded, template_kwargs)
    return Policy(built, loaded, template, context=context)


def _model_dir(spec: str) -> Path:
    """A policy's model directory: the directory given, or a Hugging Face name's snapshot in the cache."""
    from trajlab.models.hub import resolve_model_dir

    try:
        return resolve_model_dir(spec, "the policy")
    except OSError as exc:
        raise UserError(f"--policy must be 'oracle', a model directory, a Hugging Face model name or a server URL "
                        f"(http://host:port/v1[#model]): {exc}") from exc


def _processor(path: str) -> Any:
    """A model directory's image processor, or None for a text model."""
    from trajlab.models.loading import load_processor

    return load_processor(path)


def _model_generator(path: str, tokenizer: PreTrainedTokenizerBase, processor: Any, *, backend: str, device: str,
                     dtype: str, max_batch_size: int, engine_args: dict[str, Any] | None,
                     batching: Batching) -> Generator:
    """The generator of a model directory on the chosen backend (vLLM places the model on its own platform and gets
    ``engine_args``, else a dtype other than auto)."""
    if backend == "vllm":
        from trajlab.inference.vllm import VLLMGenerator

        if engine_args is None:
            engine_args = None if dtype == AUTO else {"dtype": dtype}
        return VLLMGenerator(path, max_batch_size=max_batch_size, name=path, engine_args=engine_args,
                             batching=batching)
    if backend != "hf":
        raise UserError(f"unknown backend {backend!r}: use 'hf' or 'vllm'.")
    from trajlab.inference.hf import HFGenerator
    from trajlab.models.loading import load_model

    return HFGenerator(load_model(path, device=device, dtype=dtype), tokenizer, max_batch_size=max_batch_size,
                       name=path, processor=processor)


def _tokenizer(tokenizer: str | Path | PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    from trajlab.models.loading import load_tokenizer

    return tokenizer if isinstance(tokenizer, PreTrainedTokenizerBase) else load_tokenizer(tokenizer)


def oracle_policy(oracle: Any, tokenizer: str | Path | PreTrainedTokenizerBase | None, vision: bool,
                  template_kwargs: Mapping[str, Any] | None = None) -> Policy:
    """The env's reference policy ``oracle`` writing its trajectories in ``tokenizer``'s tokens (default: the tiny
    model's, or the tiny vision-language model's when the env shows images)."""
    from trajlab.inference.scripted import ScriptedGenerator
    from trajlab.models.tiny import ensure_default_model
    from trajlab.models.tiny_vision import ensure_default_vision_model

    if oracle is None:
        raise UserError("this env has no reference policy ('oracle'): pass a model directory or a server URL.")
    source = tokenizer or (ensure_default_vision_model() if vision else ensure_default_model())
    loaded = _tokenizer(source)
    template, context = resolve_chat(loaded, template_kwargs)
    processor = _processor(str(source)) if isinstance(source, str | Path) else None
    return Policy(ScriptedGenerator(oracle, loaded, template, name="oracle", context=context), loaded, template,
                  processor, context)


def _server_policy(url: str, tokenizer: str | Path | PreTrainedTokenizerBase | None,
                   template_kwargs: Mapping[str, Any] | None, timeout_s: float) -> Policy:
    """An OpenAI-compatible server, read with the local tokenizer of the model it serves."""
    from trajlab.inference.openai_client import OpenAIGenerator, served_model, split_policy_url

    if tokenizer is None:
        raise UserError(f"--policy {url} is a server: pass --tokenizer with the served model's directory (prompts "
                        "are rendered and tool calls read locally, in its tokens).")
    base_url, model = split_policy_url(url)
    model = served_model(base_url, model)
    loaded = _tokenizer(tokenizer)
    processor = _processor(str(tokenizer)) if isinstance(tokenizer, str | Path) else None
    template, context = resolve_chat(loaded, template_kwargs)
    return Policy(OpenAIGenerator(base_url, model, loaded, turn_timeout_s=timeout_s), loaded, template, processor,
                  context)
