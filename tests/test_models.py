"""The tiny offline default: model, tokenizer, chat template, response parsing, and the loaders."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.chat_template_utils import (
    has_generation_markers,
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
    qwen2_5_chat_template,
    qwen3_template,
)

from trajlab.models import devices
from trajlab.models.devices import resolve_device, resolve_dtype
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.models.offline_tokenizer import build_offline_tokenizer
from trajlab.models.tiny import (
    TINY_ADDED_TOKENS,
    TINY_CHAT_TEMPLATE,
    TINY_RESPONSE_TEMPLATE,
    TINY_SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    init_tiny_model,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the secret number.",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "description": "the number to try"}},
                "required": ["n"],
            },
        },
    }
]


def _call(n: int | str) -> dict:
    arguments = n if isinstance(n, str) else {"n": n}
    return {"type": "function", "function": {"name": "guess", "arguments": arguments}}


# Every transition a rollout makes: system, user, tool calls (dict and JSON-string arguments, two in one turn),
# a run of two tool results, content alongside calls, content with leading whitespace, a second user turn.
CONVERSATION = [
    {"role": "system", "content": "You play a guessing game."},
    {"role": "user", "content": "I'm thinking of a number between 1 and 100."},
    {"role": "assistant", "content": "", "tool_calls": [_call(50)]},
    {"role": "tool", "name": "guess", "content": "higher"},
    {"role": "assistant", "content": "Two at once.", "tool_calls": [_call('{"n": 75}'), _call(76)]},
    {"role": "tool", "name": "guess", "content": "lower"},
    {"role": "tool", "name": "guess", "content": "lower"},
    {"role": "assistant", "content": "\n  It is below 75."},
    {"role": "user", "content": "Go on."},
    {"role": "assistant", "content": None, "tool_calls": [_call(62)]},
    {"role": "tool", "name": "guess", "content": "Correct!"},
    {"role": "assistant", "content": "Found it: 62."},
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("tiny") / "model"
    start = time.perf_counter()
    init_tiny_model(out, seed=0)
    return out, time.perf_counter() - start


@pytest.fixture(scope="module")
def tiny_dir(built: tuple[Path, float]) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def tok(tiny_dir: Path):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    return load_model(tiny_dir)


def _ids(tok, messages: list[dict], **kwargs) -> list[int]:
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False, **kwargs)


def _text(tok, messages: list[dict], **kwargs) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)


# --- the model -------------------------------------------------------------------------------------------------------


def test_builds_in_seconds(built: tuple[Path, float]) -> None:
    assert built[1] < 30


def test_parameter_count_is_tiny(model) -> None:
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 10_000_000


def test_saved_model_loads_with_plain_transformers(tiny_dir: Path, tok) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    assert type(plain).__name__ == "Qwen3ForCausalLM"
    assert (tiny_dir / "model.safetensors").is_file()
    assert plain.config.vocab_size == len(tok)
    assert plain.config.tie_word_embeddings
    assert tok.model_max_length == plain.config.max_position_embeddings
    assert plain.generation_config.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert plain.generation_config.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")


def test_load_model_is_eval_mode_and_honours_dtype(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, dtype=torch.bfloat16)
    assert not model.training
    assert model.dtype == torch.bfloat16
    assert load_model(tiny_dir, dtype="bfloat16").dtype == torch.bfloat16
    assert load_model(tiny_dir, device="cpu", dtype="float16").dtype == torch.float16
    assert load_model(tiny_dir).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machines without a GPU")
def test_auto_is_the_cpu_in_float32_without_a_gpu(tiny_dir: Path) -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu"), saved=torch.bfloat16) == torch.float32
    model = load_model(tiny_dir)
    assert model.device.type == "cpu" and model.dtype == torch.float32
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=rf"device '{name}': torch .* sees no CUDA GPU on this machine; use "
                                             "--device cpu"):
            load_model(tiny_dir, device=name)


@pytest.mark.parametrize(("name", "message"), [("gpu", "not one trajlab runs on"), ("meta", "not one trajlab runs on"),
                                               ("cuda:x", "not one trajlab runs on")])
def test_unknown_devices_and_dtypes_are_clear_errors(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_device(name)
    with pytest.raises(ValueError, match="use auto, float32, bfloat16 or float16"):
        resolve_dtype("half", torch.device("cpu"))


@pytest.mark.parametrize("units", [True, False])
def test_bfloat16_on_a_cpu_without_bfloat16_units_is_warned_once(monkeypatch, caplog, units) -> None:
    # Both kinds of CPU, whichever this one is: only its reported instruction sets are replaced.
    monkeypatch.setattr(devices.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: units)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    devices._warn_emulated_bfloat16.cache_clear()
    for _ in range(2):
        assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    resolve_dtype("float32", torch.device("cpu"))
    warned = [r.getMessage() for r in caplog.records if r.name == "trajlab.models.devices"]
    assert len(warned) == (0 if units else 1)
    if not units:
        assert "without bfloat16 instructions" in warned[0] and "Use float32" in warned[0]


@pytest.mark.parametrize(("bf16", "saved", "expected"), [
    (True, torch.bfloat16, torch.bfloat16), (True, torch.float32, torch.float32), (True, None, torch.float32),
    (False, torch.bfloat16, torch.float32), (False, torch.float16, torch.float16),
])
def test_auto_dtype_on_a_gpu_is_the_checkpoints_own(monkeypatch, bf16, saved, expected) -> None:
    # Stand-in for a GPU, which this machine lacks: only its bfloat16 support is asked.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "a GPU without bfloat16")
    assert resolve_dtype("auto", torch.device("cuda"), saved=saved) == expected
    if not bf16:
        with pytest.raises(ValueError, match="does not support it"):
            resolve_dtype("bfloat16", torch.device("cuda"))


def test_generate_produces_new_tokens(model, tok) -> None:
    inputs = tok.apply_chat_template(
        CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert new.shape == (6,)
    assert int(new.max()) < len(tok)
    again = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(out, again)


def test_same_seed_same_weights_other_seed_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    reference = load_file(tiny_dir / "model.safetensors")
    same = load_file(init_tiny_model(tmp_path / "same", seed=0) / "model.safetensors")
    other = load_file(init_tiny_model(tmp_path / "other", seed=1) / "model.safetensors")
    assert reference.keys() == same.keys() == other.keys()
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    assert not torch.equal(reference["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_tokenizer_training_is_deterministic(tok) -> None:
    fresh = build_offline_tokenizer(
        TINY_CHAT_TEMPLATE,
        list(TINY_SPECIAL_TOKENS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        vocab_size=TINY_VOCAB_SIZE,
        added_tokens=TINY_ADDED_TOKENS,
    )
    saved = json.loads(tok.backend_tokenizer.to_str())["model"]
    assert json.loads(fresh.backend_tokenizer.to_str())["model"] == saved
    assert fresh.get_vocab() == tok.get_vocab()


def test_init_refuses_to_clobber(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="overwrite=True"):
        init_tiny_model(tiny_dir, seed=0)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="config.json"):
        init_tiny_model(precious, overwrite=True, seed=0)
    assert (precious / "notes.txt").read_text() == "keep me"
    replaced = tmp_path / "again"
    shutil.copytree(tiny_dir, replaced)
    (replaced / "stale.bin").write_text("old")
    init_tiny_model(replaced, seed=3, overwrite=True)
    assert not (replaced / "stale.bin").exists()
    assert (replaced / "config.json").is_file()


# --- the tokenizer ---------------------------------------------------------------------------------------------------


def test_tokenizer_identity(tok) -> None:
    assert len(tok) == TINY_VOCAB_SIZE  # the synthetic corpus is rich enough to fill the vocabulary
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    assert tok.chat_template == TINY_CHAT_TEMPLATE
    assert set(TINY_SPECIAL_TOKENS) <= set(tok.all_special_tokens)
    assert not set(TINY_ADDED_TOKENS) & set(tok.all_special_tokens)
    for marker in (*TINY_SPECIAL_TOKENS, *TINY_ADDED_TOKENS):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_tool_call_json_is_compact(tok) -> None:
    call = '{"name": "guess", "arguments": {"n": 50}}'
    assert len(tok.encode(call, add_special_tokens=False)) <= 16


def test_a_number_is_the_same_digit_tokens_in_every_context(tok) -> None:
    digits = [tok.convert_tokens_to_ids(d) for d in "1807"]
    for context in ("(1807", ": 1807}", "\n1807\n", " 1807.", "x=1807"):
        ids = tok.encode(context, add_special_tokens=False)
        assert any(ids[i:i + 4] == digits for i in range(len(ids))), context


_MARKERS = st.sampled_from([*TINY_SPECIAL_TOKENS, *TINY_ADDED_TOKENS, "\n", " ", "\r\n", '{"'])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(), _MARKERS), max_size=8).map("".join))
def test_decode_inverts_encode_for_any_text(tok, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_skip_special_tokens_keeps_tool_markers(tok) -> None:
    call = '<tool_call>\n{"name": "guess"}\n</tool_call>'
    text = f"<|im_start|>assistant\n{call}<|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == f"assistant\n{call}"


def test_build_offline_tokenizer_rejects_unlisted_eos() -> None:
    with pytest.raises(ValueError, match="special_tokens"):
        build_offline_tokenizer("{{ messages }}", ["<pad>"], eos_token="</s>", corpus=["a b"])


# --- the chat template -----------------------------------------------------------------------------------------------


def test_template_is_prefix_preserving_in_text_and_tokens(tok) -> None:
    for k in range(1, len(CONVERSATION)):
        shorter, longer = CONVERSATION[:k], CONVERSATION[: k + 1]
        assert _text(tok, longer).startswith(_text(tok, shorter)), k
        assert _ids(tok, longer)[: len(_ids(tok, shorter))] == _ids(tok, shorter), k
        if CONVERSATION[k]["role"] == "assistant":
            prompt = _ids(tok, shorter, add_generation_prompt=True)
            assert _ids(tok, longer)[: len(prompt)] == prompt, k


def test_trl_accepts_the_template(tok) -> None:
    assert has_generation_markers(tok.chat_template)
    assert is_chat_template_prefix_preserving(tok)
    assert is_chat_template_stop_token_trained(tok)


def test_template_renders_tools_and_grouped_tool_results(tok) -> None:
    text = _text(tok, CONVERSATION[:7], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou play a guessing game.\n\nTools:\n- guess(")
    name, description = TOOLS[0]["function"]["name"], TOOLS[0]["function"]["description"]
    arguments = ", ".join(f"{k}: {v['type']}" for k, v in TOOLS[0]["function"]["parameters"]["properties"].items())
    assert f"\n- {name}({arguments}): {description}\n" in text
    assert '<tool_call>\n{"name": "guess", "arguments": {"n": 75}}\n</tool_call>' in text
    grouped = "<|im_start|>user\n<tool_response>\nlower\n</tool_response>\n<tool_response>\nlower\n</tool_response>"
    assert text.endswith(grouped + "<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>system\nhi<|im_end|>\n" in tok.apply_chat_template(
        [{"role": "system", "content": "hi"}, {"role": "user", "content": "yo"}], tokenize=False
    )


def test_assistant_mask_covers_exactly_the_assistant_output(tok) -> None:
    out = tok.apply_chat_template(CONVERSATION, tools=TOOLS, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(mask) == len(ids)
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    assistants = [i for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"]
    assert len(spans) == len(assistants)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for (lo, hi), k in zip(spans, assistants, strict=True):
        prompt = _text(tok, CONVERSATION[:k], add_generation_prompt=True)
        expected = _text(tok, CONVERSATION[: k + 1])[len(prompt) :].removesuffix("\n")
        assert tok.decode(ids[lo:hi]) == expected
        assert ids[hi - 1] == eos
        assert ids[:lo] == _ids(tok, CONVERSATION[:k], add_generation_prompt=True)


# --- response parsing ------------------------------------------------------------------------------------------------


def test_parse_response_gives_back_the_tool_calls(tok) -> None:
    k = 4  # content plus two calls, one with string arguments
    prompt = _text(tok, CONVERSATION[:k], add_generation_prompt=True)
    generated = _text(tok, CONVERSATION[: k + 1])[len(prompt) :]
    parsed = tok.parse_response(generated, prefix=prompt)
    assert parsed == {
        "role": "assistant",
        "content": "Two at once.",
        "tool_calls": [
            {"type": "function", "function": {"name": "guess", "arguments": {"n": 75}}},
            {"type": "function", "function": {"name": "guess", "arguments": {"n": 76}}},
        ],
    }
    # The way TRL calls it: token ids, generation stopped at <|im_end|>, prompt ids as prefix.
    prompt_ids = _ids(tok, CONVERSATION[:k], add_generation_prompt=True)
    generated_ids = tok.encode(generated.removesuffix("\n"), add_special_tokens=False)
    assert tok.parse_response(generated_ids, prefix=prompt_ids) == parsed


def test_parse_response_plain_answer(tok) -> None:
    prompt = _text(tok, CONVERSATION[:2], add_generation_prompt=True)
    assert tok.parse_response("Fifty.<|im_end|>", prefix=prompt) == {"role": "assistant", "content": "Fifty."}


# --- the loaders -----------------------------------------------------------------------------------------------------


def test_response_template_survives_save_and_load(tiny_dir: Path) -> None:
    plain = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert plain.response_template == TINY_RESPONSE_TEMPLATE
    assert plain.chat_template == TINY_CHAT_TEMPLATE


def test_load_tokenizer_attaches_the_tiny_response_template_when_missing(tiny_dir: Path, tmp_path: Path) -> None:
    # A tokenizer_config.json written by a tool that drops keys it does not know.
    for name in ("tokenizer.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    del config["response_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(tmp_path, local_files_only=True).response_template is None
    assert load_tokenizer(tmp_path).response_template == TINY_RESPONSE_TEMPLATE


def test_load_tokenizer_other_templates(tiny_dir: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    tok.response_template = None
    tok.pad_token = None
    tok.chat_template = qwen2_5_chat_template
    tok.save_pretrained(tmp_path / "qwen")
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tok.save_pretrained(tmp_path / "unknown")

    known = load_tokenizer(tmp_path / "qwen")
    assert known.response_template == qwen3_template
    unknown = load_tokenizer(tmp_path / "unknown")
    assert unknown.response_template is None
    assert unknown.pad_token == unknown.eos_token == "<|im_end|>"


@pytest.mark.parametrize("loader", [load_model, load_tokenizer])
def test_missing_path_is_a_clear_error(loader, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        loader(missing)
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(NotADirectoryError, match="file.txt"):
        loader(tmp_path / "file.txt")


def test_directory_without_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(OSError, match="not a tokenizer directory"):
        load_tokenizer(tmp_path)
