"""Chat templates at the token level: prefix-preservation check and observation deltas.

A multi-turn rollout appends tokens; it never re-renders the history. That is only correct when the chat template
is prefix-preserving (rendering more messages never changes how earlier ones render). Templates that rewrite
history, such as stock Qwen3 dropping past ``<think>`` blocks, are detected here and either swapped for TRL's
training-safe variant or trained one sample per turn (:mod:`trajlab.rollout.samples`).
"""

from __future__ import annotations

import copy
import functools
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trajlab.chat.context import TemplateContext, context_for_run

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class TemplateNotPrefixPreservingError(ValueError):
    """The chat template re-renders earlier messages when new ones are appended."""


def _call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# A conversation that exercises every transition a rollout makes: reasoning, one and two tool calls in a turn,
# tool results, a second user query (where history-rewriting templates strip earlier reasoning), a plain answer.
# Call ids are 9 alphanumeric characters, the form Mistral's templates require (and the engine writes).
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        },
    }
]
PROBE_MESSAGES: list[Message] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What does apple mean?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
     "tool_calls": [_call("lookup", {"word": "apple"}, "call00001")]},
    {"role": "tool", "name": "lookup", "tool_call_id": "call00001", "content": "a fruit"},
    {"role": "assistant", "content": "It is a fruit.", "reasoning_content": "The tool answered."},
    {"role": "user", "content": "And pear and plum?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two lookups.",
     "tool_calls": [_call("lookup", {"word": "pear"}, "call00002"), _call("lookup", {"word": "plum"}, "call00003")]},
    {"role": "tool", "name": "lookup", "tool_call_id": "call00002", "content": "another fruit"},
    {"role": "tool", "name": "lookup", "tool_call_id": "call00003", "content": "a stone fruit"},
    {"role": "assistant", "content": "Both are fruits."},
]
PROBE_SINGLE_CALLS: list[Message] = [
    *PROBE_MESSAGES[:6],
    {"role": "assistant", "content": "", "reasoning_content": "One lookup.",
     "tool_calls": [_call("lookup", {"word": "pear"}, "call00002")]},
    PROBE_MESSAGES[7],
    PROBE_MESSAGES[9],
]


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    chat_template: str | None = None,
    context: TemplateContext | None = None,
) -> str:
    """The conversation as the template writes it; ``context``: the run's template variables and pinned date."""
    kwargs: dict[str, Any] = {}
    if context is not None:
        chat_template, kwargs = context.prepare(chat_template or own_template(tokenizer))
    return tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **kwargs,
    )


def own_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's own chat template (the default one of several)."""
    template = tokenizer.chat_template
    return template["default"] if isinstance(template, dict) else template


def find_prefix_violation(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None, context: TemplateContext | None = None
) -> str | None:
    """Replay the probe conversation the way a rollout grows it; describe the first rewrite of history, or None.

    A rollout makes two kinds of step: the model's turn after a generation prompt, and a batch of observations
    (tool results, a user turn) after the model's turn. Each must leave the text rendered so far untouched.
    """
    thinking_off = context is not None and False in (context.kwargs.get("enable_thinking"),
                                                     context.kwargs.get("thinking"))
    try:
        return _replay_probe(tokenizer, _probe(PROBE_MESSAGES, thinking_off), chat_template, context)
    except TemplateError:
        # Some templates (Llama 3.1) refuse several calls in one turn; probe them with one call per turn.
        return _replay_probe(tokenizer, _probe(PROBE_SINGLE_CALLS, thinking_off), chat_template, context)


def _probe(messages: list[Message], thinking_off: bool) -> list[Message]:
    """The probe as the model writes it: with thinking switched off (``enable_thinking: false``), no reasoning."""
    if not thinking_off:
        return messages
    return [{key: value for key, value in m.items() if key != "reasoning_content"} for m in messages]


def _replay_probe(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], chat_template: str | None,
    context: TemplateContext | None,
) -> str | None:
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    steps = [(assistants[0], assistants[0] + 1, False)]  # (messages known, messages after the step, prompt after)
    for previous, current in zip(assistants, assistants[1:], strict=False):
        steps.append((previous + 1, current, True))  # observations, then the next generation prompt
        steps.append((current, current + 1, False))  # the model's turn
    for known, grown, with_prompt in steps:
        earlier = render(tokenizer, messages[:known], PROBE_TOOLS, add_generation_prompt=not with_prompt,
                         chat_template=chat_template, context=context)
        later = render(tokenizer, messages[:grown], PROBE_TOOLS, add_generation_prompt=with_prompt,
                       chat_template=chat_template, context=context)
        if not later.startswith(earlier):
            at = next((i for i, (x, y) in enumerate(zip(earlier, later, strict=False)) if x != y), len(earlier))
            added = ", ".join(m["role"] for m in messages[known:grown])
            return (
                f"appending [{added}] after message {known - 1} changed the rendering of earlier messages at "
                f"character {at}: {earlier[at:at + 40]!r} became {later[at:at + 40]!r}"
            )
    return None


def resolve_chat_template(
    tokenizer: PreTrainedTokenizerBase, on_unsafe: Literal["swap", "branch", "refuse"] = "swap",
    context: TemplateContext | None = None,
) -> str:
    """The chat template to roll out with: the tokenizer's own if prefix-preserving; else, for ``on_unsafe``:

    - ``"swap"``: TRL's prefix-preserving training variant of it where TRL has one, else the template itself, whose
      episodes then train one sample per turn (:mod:`trajlab.rollout.samples`);
    - ``"branch"``: the template itself, one sample per turn (keeps what the model saw in training: e.g. stock
      Qwen3 dropping earlier reasoning);
    - ``"refuse"``: raise.

    ``context``: the variables it renders with (``enable_thinking`` may change what it does to history).

    Raises:
        TemplateNotPrefixPreservingError: the template rewrites history and ``on_unsafe="refuse"``.
    """
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template["default"]
    if template is None:
        raise ValueError(
            f"Tokenizer {tokenizer.name_or_path!r} has no chat template; set tokenizer.chat_template or use a chat "
            "model."
        )
    violation = find_prefix_violation(tokenizer, template, context)
    if violation is None:
        return template
    message = f"The chat template of {tokenizer.name_or_path!r} is not prefix-preserving: {violation}."
    if on_unsafe == "refuse":
        raise TemplateNotPrefixPreservingError(
            f"{message} Multi-turn rollouts that append tokens would train on tokens that differ from what the "
            "template renders. Fix: pass a prefix-preserving chat template (TRL ships training variants under "
            "trl/chat_templates/*_training.jinja), or train one sample per turn (on_unsafe='branch')."
        )
    if on_unsafe == "swap":
        from trl.chat_template_utils import get_training_chat_template

        try:
            safe = get_training_chat_template(tokenizer)
        except (ValueError, NotImplementedError):
            safe = None
        if safe is not None and find_prefix_violation(tokenizer, safe, context) is None:
            logger.warning("%s Using TRL's prefix-preserving training variant of this template instead.", message)
            return safe
    logger.warning("%s Its episodes train one sample per turn: each turn's prompt is the template's own rendering "
                   "of the conversation so far.", message)
    return template


def resolve_chat(tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None = None,
                 on_unsafe: Literal["swap", "branch", "refuse"] = "swap") -> tuple[str, TemplateContext]:
    """The template a run renders with (:func:`resolve_chat_template`) and its context: ``template_kwargs`` and,
    when the template reads the date, today's pinned for the run."""
    template = resolve_chat_template(tokenizer, on_unsafe, TemplateContext(kwargs=dict(template_kwargs or {})))
    return template, context_for_run(template, template_kwargs)


class ChatTemplate:
    """Token-level view of one episode's chat: prompt tokens and the tokens each new observation adds.

    Args:
        tokenizer: the model's tokenizer.
        tools: tool schemas rendered into the prompt.
        chat_template: the template :func:`resolve_chat_template` chose.
        processor: a vision-language model's processor (None: a text model). Messages may then hold image parts
            (``{"type": "image", "image": <id>}``); the processor turns each one's placeholder into the image's
            tokens, as many as the image needs.
        images: the PIL image of each image id in the messages (see :meth:`with_images`).
        context: the template variables and pinned date it renders with (see :mod:`trajlab.chat.context`).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]], chat_template: str,
        processor: Any = None, images: Callable[[str], Any] | None = None, context: TemplateContext | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.context = context or TemplateContext()
        self.tools = tools
        self.chat_template = chat_template
        self.processor = processor
        self.images = images
        # Read once: it scans the vocabulary (150k entries for real models), and every turn needs it.
        self._end_of_turn = end_of_turn_texts(tokenizer)

    def with_tools(self, tools: list[dict[str, Any]]) -> ChatTemplate:
        """The same template rendering other tools (an episode offering some tools only), sharing what was read."""
        other = copy.copy(self)
        other.tools = tools
        return other

    def with_context(self, context: TemplateContext) -> ChatTemplate:
        """The same template rendering with other variables (a trajectory's recorded ones)."""
        other = copy.copy(self)
        other.context = context
        other.__dict__.pop("preserves_prefixes", None)  # the variables may change what it does to history
        return other

    @functools.cached_property
    def preserves_prefixes(self) -> bool:
        """Whether appending messages leaves the rendering of earlier ones untouched (else episodes branch)."""
        return find_prefix_violation(self.tokenizer, self.chat_template, self.context) is None

    def with_images(self, images: Callable[[str], Any]) -> ChatTemplate:
        """The same template reading one episode's (or trajectory's) images: ``images(id)`` is a PIL image."""
        other = copy.copy(self)
        other.images = images
        return other

    def render(self, messages: list[Message], *, add_generation_prompt: bool = False) -> str:
        return render(self.tokenizer, messages, self.tools, add_generation_prompt=add_generation_prompt,
                      chat_template=self.chat_template, context=self.context)

    def encode(self, text: str, images: Sequence[Any] = ()) -> list[int]:
        """Token ids of rendered text; ``images`` are those whose placeholders the text holds, in order."""
        # Special tokens come from the rendered text itself (e.g. a template's own <|begin_of_text|>), so the
        # tokenizer must not add any of its own.
        if not images:
            return self.tokenizer.encode(text, add_special_tokens=False)
        encoded = self.processor(text=text, images=list(images), add_special_tokens=False)
        return list(encoded["input_ids"][0])

    def images_of(self, messages: list[Message]) -> list[Any]:
        """The PIL images of the image parts of ``messages``, in order."""
        ids = image_ids(messages)
        if ids and self.processor is None:
            raise ValueError(f"the conversation holds {len(ids)} image(s), but the policy is a text model (no image "
                             "processor): use a vision-language model, e.g. `trajlab model init --vision DIR`")
        if ids and self.images is None:
            raise ValueError("messages hold image parts, but this chat template was given no images (with_images)")
        return [self.images(image_id) for image_id in ids]  # type: ignore[misc]

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        images = self.images_of(messages)  # first: a text template cannot render image parts
        return self.encode(self.render(messages, add_generation_prompt=True), images)

    def observation_ids(
        self, history: list[Message], new_messages: list[Message], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Tokens that follow the model's last turn (which ended on an end-of-turn token) when messages are appended.

        ``history`` ends with the assistant message of that turn. The delta is taken on rendered text, so it never
        depends on how the assistant's own tokens would be re-tokenized; it starts with whatever the template
        writes after the end-of-turn token inside the assistant turn (e.g. ChatML's newline after ``<|im_end|>``).
        """
        images = self.images_of(new_messages)  # first: a text template cannot render image parts
        base = self.render(history)
        full = self.render(history + new_messages, add_generation_prompt=add_generation_prompt)
        if not full.startswith(base):
            raise TemplateNotPrefixPreservingError(
                "The chat template rewrote earlier messages during the episode; refusing to append tokens that "
                "would not match the rendered conversation."
            )
        return self.encode(self._closer(history) + full[len(base):], images)

    def closing_ids(self, history: list[Message]) -> list[int]:
        """Tokens the template writes after the model's end-of-turn token when the episode ends on that turn."""
        return self.encode(self._closer(history))

    def _closer(self, history: list[Message]) -> str:
        return self._split_assistant_block(history[:-1], history[-1])[1]

    def assistant_text(self, history: list[Message], message: Message) -> str:
        """The template's own rendering of an assistant turn, up to and including its end-of-turn token.

        Scripted policies emit exactly this, so their trajectories are what the template renders.
        """
        return self._split_assistant_block(history, message)[0]

    def _split_assistant_block(self, history: list[Message], message: Message) -> tuple[str, str]:
        """Split the rendered assistant turn into what the model generates and what the template adds after it."""
        before = self.render(history, add_generation_prompt=True)
        full = self.render(history + [message])
        block = full[len(before):] if full.startswith(before) else self._rewritten_turn(history, message, full)
        ends = [block.rfind(text) + len(text) for text in self._end_of_turn if text in block]
        cut = max(ends) if ends else len(block)
        return block[:cut], block[cut:]

    def _rewritten_turn(self, history: list[Message], message: Message, full: str) -> str:
        """The assistant turn at the end of ``full`` when appending it rewrote earlier turns (Mistral moves its system
        prompt off the last user message once a reply follows; gpt-oss drops earlier calls' analysis once an answer
        does), so it does not start where the generation prompt ended. It starts after the message before it and the
        generation prompt, which are found by rendering that message with a marker as its content."""
        marked = [*history[:-1], {**history[-1], "content": _TURN_MARKER}] if history else []
        prompt = self.render(marked, add_generation_prompt=True)
        rendered = self.render(marked + [message])
        if _TURN_MARKER not in prompt or _TURN_MARKER not in rendered:
            raise TemplateNotPrefixPreservingError("The chat template rewrote earlier messages when the assistant's "
                                                   "turn was appended, and where that turn starts cannot be found.")
        between = prompt[prompt.rindex(_TURN_MARKER) + len(_TURN_MARKER):]  # the message's close, the gen prompt
        at = rendered.rindex(_TURN_MARKER) + len(_TURN_MARKER)
        block = rendered[at + len(between):]
        if not rendered.startswith(between, at) or not full.endswith(block):
            raise TemplateNotPrefixPreservingError("The chat template rewrote earlier messages when the assistant's "
                                                   "turn was appended, and renders that turn differently in context.")
        return block


_TURN_MARKER = "TRAJLABTURNMARKER7F3A9C"  # letters only: JSON-encoding a tool result (gpt-oss) leaves it as it is


def image_ids(messages: list[Message]) -> list[str]:
    """The ids of the image parts of ``messages`` (``{"type": "image", "image": <id>}``), in order."""
    return [part["image"] for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"]


END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                      "<｜end▁of▁sentence｜>")
HARMONY_MARKERS = ("<|channel|>", "<|call|>", "<|return|>")
HARMONY_TURN_ENDS = ("<|call|>", "<|return|>")
"""gpt-oss (harmony) ends a turn at a call or at its final answer. Its ``<|end|>`` only closes one message of a turn
(the analysis before a call), so stopping there would cut every call off."""


REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
"""The assistant-message keys reasoning arrives under: vLLM's and DeepSeek's, vLLM's newer one, gpt-oss's."""
_READS_THINKING = re.compile(r"""message\s*(?:\.thinking\b|\[\s*["']thinking["']\s*\])""")


def reasoning_field(chat_template: str) -> str:
    """The assistant-message key ``chat_template`` reads reasoning from: gpt-oss's reads ``thinking``, the others
    (Qwen3, Qwen3.5, DeepSeek, GLM) ``reasoning_content``; a template reading neither drops it either way."""
    if _READS_THINKING.search(chat_template) and "reasoning_content" not in chat_template:
        return "thinking"
    return "reasoning_content"


def end_of_turn_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Token texts that end a model turn: the eos token plus the end-of-turn markers of this vocabulary's format."""
    vocab = tokenizer.get_vocab()
    known = HARMONY_TURN_ENDS if all(marker in vocab for marker in HARMONY_MARKERS) else END_OF_TURN_TOKENS
    texts = [text for text in known if text in vocab]
    if tokenizer.eos_token and tokenizer.eos_token not in texts:
        texts.append(tokenizer.eos_token)
    return texts


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a model turn's generation (:func:`end_of_turn_texts`)."""
    return sorted({tokenizer.convert_tokens_to_ids(text) for text in end_of_turn_texts(tokenizer)})
