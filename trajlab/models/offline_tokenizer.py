"""A byte-level BPE tokenizer trained in memory on synthetic tool-calling chats: no file is downloaded.

What the tiny offline models (:mod:`trajlab.models.tiny`, :mod:`trajlab.models.tiny_vision`) tokenize with: their
corpus is chats rendered through their own chat template, plus free English, so JSON, digits and words merge.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

CORPUS_CHATS = 1500
"""Synthetic chats in the corpus (each followed by a paragraph of free English)."""
CORPUS_SEED = 0
"""The corpus is fixed: every tokenizer built from the same template has the same merges and ids."""

_ENGLISH = (
    "the a an and or but if then else when while for to of in on at by with from into about over under after before "
    "is are was were be been being have has had do does did can could will would should may might must not no yes "
    "I you he she it we they me him her us them my your his its our their this that these those what which who how "
    "why where there here all any some each every many much more most less few one two three four five six seven "
    "eight nine ten hundred thousand first last next new old good bad right wrong true false done again still just "
    "only also very too so now time day way thing number numbers guess guessed guessing higher lower correct "
    "incorrect between range secret try tries attempt attempts left win won lose lost game score reward answer "
    "question result results value values total sum add subtract multiply divide equal greater smaller less than "
    "minimum maximum count list item items name names file files read write open close path line lines text word "
    "words letter letters search find found query city weather temperature today tomorrow date price stock order "
    "user assistant system tool tools call calls function functions argument arguments parameter parameters type "
    "string integer boolean object array required description returns error invalid missing unknown status ok "
    "success failed please thank thanks hello hi sure let think know need want use make get set go see look give "
    "take tell ask work call move step start stop end finish check run test output input data message response"
)

_WORDS = _ENGLISH.split()

_TOOL_VERBS = ("get", "set", "find", "search", "read", "write", "list", "add", "move", "check", "submit", "guess")

_TOOL_NOUNS = ("number", "weather", "file", "price", "user", "order", "word", "item", "score", "answer", "city")

_PARAM_TYPES = ("integer", "string", "number", "boolean")

_OBSERVATIONS = ("higher", "lower", "Correct!", "Too high.", "Too low.", "correct", "wrong", "ok", "done")


def _argument_value(rng: random.Random, kind: str) -> int | float | str | bool:
    if kind == "integer":
        return rng.choice((rng.randint(0, 100), rng.randint(0, 1000), rng.randint(-50, 50)))
    if kind == "number":
        return round(rng.uniform(-100, 1000), rng.randint(1, 3))
    if kind == "boolean":
        return rng.random() < 0.5
    return " ".join(rng.choices(_WORDS, k=rng.randint(1, 3)))


def _sentence(rng: random.Random, low: int = 3, high: int = 14) -> str:
    words = rng.choices(_WORDS, k=rng.randint(low, high))
    for i in rng.sample(range(len(words)), k=min(2, len(words))):
        words[i] = str(rng.randint(0, 1000))
    return (" ".join(words).capitalize() + rng.choice((".", "?", "!", ":", ","))).strip()


def _synthetic_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """One random multi-turn tool-calling conversation and its tool schemas."""
    tools = []
    for _ in range(rng.randint(1, 3)):
        params = {
            rng.choice(_TOOL_NOUNS + ("n", "x", "query", "path")): {
                "type": rng.choice(_PARAM_TYPES),
                "description": _sentence(rng, 2, 6),
            }
            for _ in range(rng.randint(1, 3))
        }
        name = rng.choice((rng.choice(_TOOL_VERBS), f"{rng.choice(_TOOL_VERBS)}_{rng.choice(_TOOL_NOUNS)}"))
        function = {"name": name, "description": _sentence(rng, 4, 10), "parameters": {"type": "object"}}
        function["parameters"].update({"properties": params, "required": list(params)})
        tools.append({"type": "function", "function": function})
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _sentence(rng)})
    messages.append({"role": "user", "content": _sentence(rng)})
    for _ in range(rng.randint(1, 4)):
        calls = []
        for tool in rng.sample(tools, k=rng.randint(1, len(tools))):
            props = tool["function"]["parameters"]["properties"]
            arguments = {key: _argument_value(rng, spec["type"]) for key, spec in props.items()}
            calls.append({"type": "function", "function": {"name": tool["function"]["name"], "arguments": arguments}})
        content = _sentence(rng) if rng.random() < 0.3 else ""
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for _ in calls:
            result = json.dumps({"result": rng.randint(0, 999)})
            observation = rng.choice((rng.choice(_OBSERVATIONS), _sentence(rng), result))
            messages.append({"role": "tool", "content": observation})
    messages.append({"role": "assistant", "content": _sentence(rng)})
    return messages, tools


def _synthetic_corpus(chat_template: str) -> Iterator[str]:
    """Tool-calling chats rendered through `chat_template`, plus free English, so JSON, digits and words merge."""
    rng = random.Random(CORPUS_SEED)
    for _ in range(CORPUS_CHATS):
        messages, tools = _synthetic_chat(rng)
        rendered, _ = render_jinja_template([messages], tools=tools, chat_template=chat_template)
        yield rendered[0]
        yield " ".join(_sentence(rng) for _ in range(4))


# Qwen2-style word splitting, with every digit its own token and spaces never glued to digits: the number 18 is the
# same two tokens in "(18 - 3)", in '"a": 18' and in a tool result, so a small model learns to copy numbers once
# instead of learning a separate token for every number in every context.
_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def build_offline_tokenizer(
    chat_template: str,
    special_tokens: list[str],
    *,
    eos_token: str,
    pad_token: str | None = None,
    bos_token: str | None = None,
    vocab_size: int = 2048,
    corpus: Iterable[str] | None = None,
    added_tokens: Sequence[str] = (),
    named_tokens: Mapping[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer in memory, with no files downloaded.

    Byte-level BPE encodes any string and decodes it back exactly. Newlines are split off before the byte-level
    pre-tokenizer, so a chat template whose turns meet at newlines or special tokens tokenizes the same piecewise as
    whole: text-level prefix preservation then holds at the token level too.

    Args:
        chat_template: Jinja chat template stored on the tokenizer.
        special_tokens: never split, and skipped by `decode(skip_special_tokens=True)`; get the lowest ids.
        eos_token: end-of-turn token; must be one of `special_tokens`.
        pad_token: padding token; defaults to `eos_token`.
        bos_token: optional beginning-of-sequence token.
        vocab_size: total size including special and added tokens; a small corpus may stop BPE short of it.
        corpus: training text; defaults to synthetic tool-calling chats rendered through `chat_template`.
        added_tokens: never split but kept by `decode(skip_special_tokens=True)` (tool-call markers).
        named_tokens: special tokens that multimodal processors read by name, e.g. ``{"image_token": "<img>"}``
            gives ``tokenizer.image_token`` and ``tokenizer.image_token_id``; each must be in `special_tokens`.
    """
    reserved = [*special_tokens, *added_tokens]
    named = dict(named_tokens or {})
    wanted = (eos_token, pad_token, bos_token, *named.values())
    missing = [t for t in wanted if t is not None and t not in special_tokens]
    if missing:
        raise ValueError(f"eos/pad/bos and named tokens {missing} must be listed in special_tokens {special_tokens}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), "isolated"),
            pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added_tokens),
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer does not split added tokens out of its input, so remove them or BPE spends merges on "<|im".
    split_reserved = re.compile("|".join(re.escape(t) for t in sorted(reserved, key=len, reverse=True)))
    texts = corpus if corpus is not None else _synthetic_corpus(chat_template)
    tokenizer.train_from_iterator((piece for text in texts for piece in split_reserved.split(text)), trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=chat_template,
        eos_token=eos_token,
        pad_token=pad_token or eos_token,
        bos_token=bos_token,
        extra_special_tokens=[t for t in special_tokens if t not in (eos_token, pad_token, bos_token, *named.values())],
        model_specific_special_tokens=named or None,
        clean_up_tokenization_spaces=False,
    )
