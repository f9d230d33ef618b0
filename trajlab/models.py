"""Models and tokenizers: load any local Hugging Face causal LM or vision-language model, or build the tiny offline
default.

No model hub is reachable where trajlab runs, so the default model is made here from nothing: a byte-level BPE
tokenizer trained in memory on synthetic tool-calling chats, and a randomly initialised Qwen3-architecture model.
Every other model goes through the same `load_model` / `load_tokenizer` (and, for a vision-language model,
`load_processor`) path with a different directory. The tiny vision-language model is built in `trajlab.vision`.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils.chat_template_utils import render_jinja_template
from trl.chat_template_utils import add_response_schema

TINY_CHAT_TEMPLATE: str = files("trajlab.chat").joinpath("templates/tiny.jinja").read_text(encoding="utf-8")

# How `tokenizer.parse_response` (transformers >= 5.13) reads an assistant turn rendered by TINY_CHAT_TEMPLATE:
# free text, then any number of `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, then <|im_end|>.
TINY_RESPONSE_TEMPLATE: dict = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>\s*", "content": "text"},
    },
}

# Special tokens are skipped by `decode(skip_special_tokens=True)`; the tool markers are plain added tokens (as in
# Qwen2.5), so text decoded either way still carries the tool calls a parser needs.
TINY_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_ADDED_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# About 3M parameters: generates in well under a second on two CPU cores, yet has the real architecture (GQA,
# q/k norms, RoPE, tied embeddings) so every code path a real Qwen3 model takes is exercised.
TINY_VOCAB_SIZE = 1536
TINY_MODEL_CONFIG: dict = {
    "hidden_size": 192,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 32768,  # RoPE: long multi-turn rollouts cost no parameters
    "tie_word_embeddings": True,
    # Weights drawn at std 0.1, not Qwen3's 0.02 (about 1/sqrt(width) for its 2048-4096-wide layers; here 1/sqrt(192)
    # is 0.072). At 0.02 the tiny model starts with near-silent layers, and when SFT learns to copy a number from its
    # context into a call depends on the seed: the quickstart's 600 steps reached 0.21-0.94 held-out success on 3
    # seeds. At 0.1, with the same constant SFT rate, they reach 0.945-1.000 on each of 5 (BENCHMARKS.md, "Why SFT
    # depended on the seed"; with the rate decayed, SFT on the optimal reference reaches 0.987-0.999).
    "initializer_range": 0.1,
}

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


def _synthetic_corpus(chat_template: str, n_chats: int = 1500, seed: int = 0) -> Iterator[str]:
    """Tool-calling chats rendered through `chat_template`, plus free English, so JSON, digits and words merge."""
    rng = random.Random(seed)
    for _ in range(n_chats):
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


@cache
def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer does not depend on the seed: train it once per process. It never leaves this module."""
    tokenizer = build_offline_tokenizer(
        TINY_CHAT_TEMPLATE,
        list(TINY_SPECIAL_TOKENS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        vocab_size=TINY_VOCAB_SIZE,
        added_tokens=TINY_ADDED_TOKENS,
    )
    tokenizer.response_template = TINY_RESPONSE_TEMPLATE
    tokenizer.model_max_length = TINY_MODEL_CONFIG["max_position_embeddings"]
    return tokenizer


def prepare_model_dir(out_dir: str | Path, *, overwrite: bool) -> Path:
    """The directory a model builder writes to: empty or new, or an old model directory removed when `overwrite`.

    Refuses to delete a non-empty directory that holds no `config.json`, so a mistyped path never costs data.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} already exists and is not empty; replace it with --overwrite "
                                  "(overwrite=True in Python)")
        if not (out / "config.json").is_file():
            raise FileExistsError(f"{out} holds no config.json: refusing to delete a directory that is not a model")
        shutil.rmtree(out)
    return out


def init_tiny_model(out_dir: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the tiny offline default model, tokenizer and generation config to `out_dir`.

    The tokenizer is the same for every seed (its corpus is fixed); `seed` only sets the weights, so models built
    with different seeds share token ids. `overwrite` replaces an existing model directory, and refuses to delete
    a non-empty directory that holds no `config.json`.

    Returns:
        The output directory, loadable with `load_model` / `load_tokenizer` or plain `from_pretrained`.
    """
    out = prepare_model_dir(out_dir, overwrite=overwrite)
    tokenizer = _tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **TINY_MODEL_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def default_model_dir() -> Path:
    """Where the tiny offline default model lives (``$TRAJLAB_HOME/tiny-model``, else under ``~/.cache/trajlab``)."""
    return Path(os.environ.get("TRAJLAB_HOME", Path.home() / ".cache" / "trajlab")) / "tiny-model"


def ensure_default_model() -> Path:
    """The default model's directory, built on first use: what a command without a model (the oracle's tokens,
    ``trajlab.check_env``) renders its tokens with."""
    path = default_model_dir()
    if not (path / "config.json").exists():
        init_tiny_model(path, overwrite=True)
    return path


def _require_local(name_or_path: str | Path, what: str) -> str:
    """Fail early, naming the path, instead of letting transformers report a hub lookup that cannot happen here."""
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(
            f"cannot load {what}: {str(name_or_path)!r} does not exist. trajlab loads models from local directories "
            "only (no model hub); build the offline default with `trajlab model init <dir>`."
        )
    if not path.is_dir():
        raise NotADirectoryError(f"cannot load {what}: {path} is a file, not a model directory")
    return str(path)


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory, ready for chat rendering and tool-call parsing.

    A missing `response_template` is filled in for the tiny template and for templates TRL knows (Qwen, Llama 3.1,
    ...); for other templates the tokenizer is returned without one and tool calls cannot be parsed by it.
    A missing pad token is set to the eos token: trajlab never infers padding from token ids.
    """
    path = _require_local(name_or_path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise OSError(f"cannot load tokenizer: {path} is not a tokenizer directory ({e})") from e
    return _complete_tokenizer(tokenizer)


def _complete_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Fill in what trajlab needs and a saved tokenizer may lack: a response template and a pad token."""
    if getattr(tokenizer, "response_template", None) is None:
        if tokenizer.chat_template == TINY_CHAT_TEMPLATE:
            tokenizer.response_template = TINY_RESPONSE_TEMPLATE
        else:
            with suppress(ValueError):  # unknown template: no parser, callers must bring their own
                add_response_schema(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def unwrapped_model(model: Any) -> Any:
    """The transformers model itself: for a PEFT model, the one it wraps."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def forward_inputs(model: Any) -> frozenset[str]:
    """The keyword inputs ``model``'s forward takes (a PEFT model's: the wrapped model's), to pass it only those."""
    return _forward_parameters(type(unwrapped_model(model)))


@cache
def _forward_parameters(model_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The torch device ``model.device`` names: ``auto`` is the GPU when torch sees one, else the CPU.

    Raises:
        ValueError: not a device trajlab runs on, or a GPU that torch does not see.
    """
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not one trajlab runs on: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: torch {torch.__version__} sees no CUDA GPU on this machine; use --device "
                        "cpu (or auto, which picks the GPU when there is one)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} GPU(s), numbered from cuda:0")
    return device


def resolve_dtype(name: str | torch.dtype, device: torch.device, saved: torch.dtype | None = None) -> torch.dtype:
    """The weights' dtype ``model.dtype`` names on ``device``, for a checkpoint saved in ``saved``.

    ``auto`` is float32 on the CPU (its half-precision kernels are slow) and the checkpoint's own dtype on a GPU,
    except a bfloat16 checkpoint on a GPU without bfloat16, which loads in float32. float32 checkpoints stay float32:
    ask for bfloat16 to halve their memory.

    Raises:
        ValueError: an unknown dtype, or bfloat16 on a GPU that does not support it.
    """
    if isinstance(name, torch.dtype):
        return name
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        chosen = saved or torch.float32
        return torch.float32 if chosen == torch.bfloat16 and not bf16_ok else chosen
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one trajlab loads models in: use auto, float32, bfloat16 or float16")
    if dtype == torch.bfloat16 and not bf16_ok:
        raise ValueError(f"dtype bfloat16: {torch.cuda.get_device_name(device)} does not support it; use float16 or "
                        "float32")
    return dtype


def saved_dtype(name_or_path: str | Path) -> torch.dtype | None:
    """The dtype a local model directory's weights were saved in (its config.json), None when it does not say."""
    return _config_dtype(AutoConfig.from_pretrained(name_or_path, local_files_only=True))


def _config_dtype(config: PreTrainedConfig) -> torch.dtype | None:
    saved = config.dtype
    return getattr(torch, saved) if isinstance(saved, str) else saved


def _model_config(path: str, what: str) -> PreTrainedConfig:
    """A local model directory's config, with the errors a directory that is not a model deserves."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"cannot load {what}: {path} has no config.json, so it is not a model directory")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load {what}: {path}/config.json is not a config transformers knows ({e})") from e


def is_vision_language(config: PreTrainedConfig) -> bool:
    """Whether a config is an image-text-to-text model (Gemma 3, Qwen-VL, LLaVA, ...) rather than a text-only LM."""
    return type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


def load_model(
    name_or_path: str | Path, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto"
) -> PreTrainedModel:
    """Load any local Hugging Face causal LM or vision-language model in eval mode on ``device`` in ``dtype`` (see
    :func:`resolve_device`, :func:`resolve_dtype`: by default the GPU when there is one, else the CPU in float32).

    A vision-language config loads through ``AutoModelForImageTextToText``, so the model takes ``pixel_values``
    (its processor: :func:`load_processor`); every other config through ``AutoModelForCausalLM``.
    """
    path = _require_local(name_or_path, "model")
    config = _model_config(path, "model")
    where = resolve_device(device)
    chosen = resolve_dtype(dtype, where, _config_dtype(config))
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    model = auto.from_pretrained(path, local_files_only=True, dtype=chosen)
    return model.to(where).eval()


def load_processor(name_or_path: str | Path) -> ProcessorMixin | None:
    """Load the processor (image processor, tokenizer, chat template) of a local vision-language model directory.

    Returns None for a text-only model, so a caller holding any model directory can branch on whether its policy
    sees images; the text side is :func:`load_tokenizer`'s either way. The processor's tokenizer gets the same
    fill-ins as :func:`load_tokenizer` (response template, pad token).

    Raises:
        FileNotFoundError, NotADirectoryError, ValueError: the path is not a model directory.
        OSError: a vision-language model directory without processor files.
        ImportError: the processor needs a package that is not installed (Qwen-VL processors need torchvision).
    """
    path = _require_local(name_or_path, "processor")
    if not is_vision_language(_model_config(path, "processor")):
        return None
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except ImportError as e:  # transformers' message names the package, over several lines
        raise ImportError(f"cannot load the processor of {path}: {' '.join(str(e).split())}") from e
    except (OSError, ValueError) as e:
        raise OSError(f"cannot load processor: {path} holds no processor transformers can load ({e})") from e
    _complete_tokenizer(processor.tokenizer)
    return processor
