"""The reflection LM: a plain ``prompt -> text`` callable, which is all ``gepa`` asks of one.

GEPA writes the reflection prompt (the current system prompt plus the reflective dataset) and reads the new prompt
back from the reply's fenced block. The model behind it is any trajlab policy backend: a local model directory
(generated with the ``hf`` generator under the tokenizer's chat template) or an OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trajlab.config import EvolveSettings, ModelSettings
from trajlab.inference.base import is_server_url
from trajlab.models.hub import resolve_model_dir

ReflectionLM = Callable[[str], str]


def load_reflection_lm(spec: str, *, settings: EvolveSettings, model: ModelSettings,
                       server_timeout_s: float) -> ReflectionLM:
    """``MODEL_DIR`` or ``http://host:port/v1[#model]`` as a reflection LM writing at most
    ``settings.reflection_max_new_tokens`` tokens at ``settings.reflection_temperature``; a server's model is checked
    up front, and each call may take ``server_timeout_s`` (``rollout.server_timeout_s``); a model directory is loaded
    where ``model`` says (``model.device`` / ``model.dtype``)."""
    length, temperature = settings.reflection_max_new_tokens, settings.reflection_temperature
    if is_server_url(spec):
        return ServerReflection(spec, max_new_tokens=length, temperature=temperature, timeout_s=server_timeout_s)
    try:
        local = resolve_model_dir(spec, "the reflection LM")
    except OSError as exc:
        raise ValueError(f"--reflection must be a model directory, a Hugging Face model name or a server URL "
                         f"(http://host:port/v1[#model]): {exc}") from exc
    return LocalReflection(str(local), max_new_tokens=length, temperature=temperature, device=model.device,
                           dtype=model.dtype)


class LocalReflection:
    """A local causal LM as the reflection LM: the prompt as one user turn, generated with :class:`HFGenerator`.

    Args:
        model_dir: a local Hugging Face model directory.
        max_new_tokens: the reply's length limit.
        temperature: sampling temperature (0 = greedy).
        max_prompt_tokens: longer prompts keep their last tokens (the reflective dataset is the long part).
        device, dtype: where the model is loaded, in what dtype (see :func:`trajlab.models.loading.load_model`).
    """

    def __init__(self, model_dir: str | Path, *, max_new_tokens: int, temperature: float, device: str, dtype: str,
                 max_prompt_tokens: int = 8192) -> None:
        from trajlab.chat.template import ChatTemplate, resolve_chat_template, stop_token_ids
        from trajlab.inference.hf import HFGenerator
        from trajlab.models.loading import load_model, load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.chat = ChatTemplate(self.tokenizer, [], resolve_chat_template(self.tokenizer))
        model = load_model(model_dir, device=device, dtype=dtype)
        self.generator = HFGenerator(model, self.tokenizer, max_batch_size=1, name=str(model_dir))  # one at a time
        self.stop = tuple(stop_token_ids(self.tokenizer))
        self.max_new_tokens, self.temperature, self.max_prompt_tokens = max_new_tokens, temperature, max_prompt_tokens

    def __call__(self, prompt: str | list[dict[str, Any]]) -> str:
        from trajlab.inference.base import GenerationRequest, SamplingParams

        ids = self.chat.prompt_ids([{"role": "user", "content": _text(prompt)}])[-self.max_prompt_tokens:]
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                stop_token_ids=self.stop)
        result = asyncio.run(self.generator.generate(GenerationRequest(prompt_ids=ids, params=params)))
        return self.tokenizer.decode(result.token_ids, skip_special_tokens=True)


class ServerReflection:
    """An OpenAI-compatible server's chat completions as the reflection LM (``URL#model`` picks the model).

    Args:
        url: ``http://host:port/v1[#model]``.
        max_new_tokens, temperature: the reply's length limit and sampling temperature.
        timeout_s: the most one call may take, retries included (``rollout.server_timeout_s``, as a policy's turn).
    """

    def __init__(self, url: str, *, max_new_tokens: int, temperature: float, timeout_s: float) -> None:
        from trajlab.inference.openai_client import api_key_or_placeholder, served_model, split_policy_url

        self.base_url, model = split_policy_url(url)
        self.model = served_model(self.base_url, model)
        self.api_key = api_key_or_placeholder()
        self.max_new_tokens, self.temperature, self.timeout_s = max_new_tokens, temperature, timeout_s

    def __call__(self, prompt: str | list[dict[str, Any]]) -> str:
        return asyncio.run(self._ask(_text(prompt)))

    async def _ask(self, text: str) -> str:
        import openai

        from trajlab.inference.openai_client import ServerError

        async with openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s) as client:
            try:
                async with asyncio.timeout(self.timeout_s):  # the client's own timeout is per attempt
                    reply = await client.chat.completions.create(
                        model=self.model, messages=[{"role": "user", "content": text}],
                        max_tokens=self.max_new_tokens, temperature=self.temperature,
                    )
            except (TimeoutError, openai.APITimeoutError) as exc:
                raise ServerError(f"{self.base_url}/chat/completions (the reflection LM) did not answer within "
                                  f"{self.timeout_s:g} s (rollout.server_timeout_s): is the server stuck or "
                                  "overloaded? Raise the setting for reflections that take longer.") from exc
        return reply.choices[0].message.content or ""


def _text(prompt: str | list[dict[str, Any]]) -> str:
    """GEPA sends a string, or chat messages when its dataset holds images: keep their text parts."""
    if isinstance(prompt, str):
        return prompt
    parts = []
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        else:
            parts.extend(part.get("text", "") for part in content or [] if part.get("type") == "text")
    return "\n".join(parts)
