"""CJK and emoji through the recording server on a real byte-level tokenizer (Qwen2.5's, 151,665 tokens).

A byte-level BPE model writes bytes: it may spell a character in other tokens than the tokenizer's own and end a
reply inside a character. Sessions sent back by the official SDK must still merge into one token-exact trajectory,
and no text (whole or streamed) may hold half a character. ``IdsGenerator`` stands in for a trained model writing
CJK, which cannot run here: it answers with chosen token ids; an untrained model of Qwen2.5's vocabulary, sampled by
the real ``hf`` generator, writes such tokens by itself in the last test.
"""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from transformers import Qwen2Config, Qwen2ForCausalLM

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import render, resolve_chat_template
from trajlab.chat.utf8 import BYTE_OF_CHAR, shown_text
from trajlab.config import ServeSettings
from trajlab.data.store import read_trajectories
from trajlab.inference.base import GenerationRequest, GenerationResult
from trajlab.inference.hf import HFGenerator
from trajlab.models.families import load_family_tokenizer
from trajlab.proxy import SessionRecorder, create_app
from trajlab.proxy.export import export_sessions, session_files
from trajlab.proxy.recording import read_session
from trajlab.rollout.drift import check_token_drift

from .conftest import MODEL, Served, running

CHAR_OF_BYTE = {byte: char for char, byte in BYTE_OF_CHAR.items()}


@pytest.fixture(scope="module")
def qwen():
    tokenizer = load_family_tokenizer("qwen2.5")
    return tokenizer, resolve_chat_template(tokenizer)


def byte_ids(tokenizer, text: str) -> list[int]:
    """``text`` spelled one byte per token: valid tokens, never the tokenizer's own spelling of a character."""
    return tokenizer.convert_tokens_to_ids([CHAR_OF_BYTE[byte] for byte in text.encode()])


class IdsGenerator:
    """Answers the calls in order with the given token ids (cut at the call's token budget), logprob -1 each."""

    name = "ids"

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        ids = self.replies.pop(0)[:request.params.max_new_tokens]
        finish = "stop" if ids[-1] in request.params.stop_token_ids else "length"
        return GenerationResult(ids, [-1.0] * len(ids), finish)


def replies(tokenizer) -> tuple[list[list[int]], list[str]]:
    """Three replies and the text each must show: an emoji spelled byte by byte, a reply whose stop token comes
    after half an emoji, and one cut by max_tokens (``cut``) after three of an emoji's four bytes."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encode = tokenizer.encode
    return ([encode("你好，世界！") + byte_ids(tokenizer, "🌍") + [end],
             encode("天气很好") + byte_ids(tokenizer, "😀")[:2] + [end],
             encode("谢谢") + byte_ids(tokenizer, "🎉")[:3] + encode("再见再见再见")],
            ["你好，世界！🌍", "天气很好", "谢谢"])


def cut(tokenizer) -> int:
    return len(tokenizer.encode("谢谢")) + 3


def talk(url: str, session: str, stream: bool, last_budget: int) -> tuple[list[dict], list[list[str]]]:
    """Three calls of the official SDK, each sending the conversation so far back; the streamed pieces of each."""
    api = OpenAI(base_url=f"{url}/sessions/{session}/v1", api_key="k", max_retries=0, timeout=60)
    messages, pieces = [{"role": "user", "content": "用中文说你好 👋"}], []
    for turn, user in enumerate(["再来一次 🎉", "谢谢！🙏", None]):
        request = {"model": MODEL, "messages": messages, "max_tokens": last_budget if turn == 2 else 64,
                   "temperature": 0}
        if stream:
            chunks = list(api.chat.completions.create(**request, stream=True))
            pieces.append([c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content])
            content = "".join(pieces[-1])
        else:
            content = api.chat.completions.create(**request).choices[0].message.content
        messages.append({"role": "assistant", "content": content})
        if user:
            messages.append({"role": "user", "content": user})
    return messages, pieces


@pytest.mark.parametrize("stream", [False, True])
def test_cjk_and_emoji_replies_merge_token_exact_and_never_show_half_a_character(qwen, tmp_path, stream):
    tokenizer, template = qwen
    ids, shown = replies(tokenizer)
    app = create_app(IdsGenerator(ids), tokenizer, template, get_parser("auto", tokenizer), MODEL,
                     SessionRecorder(tmp_path), ServeSettings(), 32768)
    with running(app) as url:
        messages, pieces = talk(url, "cjk", stream, cut(tokenizer))
    assert [m["content"] for m in messages if m["role"] == "assistant"] == shown
    for streamed in pieces:  # each piece whole characters: no U+FFFD standing for half of one, no lone surrogate
        assert streamed and all("\ufffd" not in piece for piece in streamed)
        assert all(piece.encode().decode() == piece for piece in streamed)  # encode raises on a lone surrogate
    records = list(read_session(tmp_path / "cjk.jsonl"))
    assert [r["choices"][0]["text"] for r in records] == shown
    assert [r["choices"][0]["token_ids"] for r in records] == [ids[0], ids[1], ids[2][:cut(tokenizer)]]
    # Tokenizing the conversation's text again would not give the model's own tokens: that is what forked before.
    second = records[1]["prompts"][0]
    assert tokenizer.encode(second["text"]) != second["token_ids"]
    assert second["token_ids"][:len(records[0]["prompts"][0]["token_ids"]) + len(ids[0])] == (
        records[0]["prompts"][0]["token_ids"] + ids[0])

    summary = export_sessions(session_files(tmp_path), tmp_path / "out.jsonl", tokenizer, template)
    assert summary["calls"] == 3 and summary["samples"] == 1
    (trajectory,) = read_trajectories(tmp_path / "out.jsonl")
    tokens = trajectory.tokens
    assert trajectory.metrics["turns"] == 3 and trajectory.metrics["template_match"] == 1.0
    assert trajectory.messages[:-1] == [dict(m) for m in messages[:-1]]
    trained = [t for t, bit in zip(tokens.completion_ids, tokens.loss_mask, strict=True) if bit]
    assert trained == [t for r in records for t in r["choices"][0]["token_ids"]]
    assert shown_text(tokenizer, tokens.prompt_ids + tokens.completion_ids) == render(
        tokenizer, trajectory.messages, [], chat_template=template)
    assert check_token_drift([trajectory], tokenizer, template, get_parser("auto", tokenizer),
                             max_drift=0.0) == ([trajectory], [])


def test_the_logprobs_bytes_of_a_split_emoji_join_into_it(qwen, tmp_path):
    tokenizer, template = qwen
    ids = byte_ids(tokenizer, "🌍") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    app = create_app(IdsGenerator([ids]), tokenizer, template, get_parser("auto", tokenizer), MODEL,
                     SessionRecorder(tmp_path), ServeSettings(), 32768)
    with running(app) as url:
        response = OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "🌍?"}], logprobs=True, max_tokens=8)
    entries = response.choices[0].logprobs.content
    assert bytes(b for entry in entries[:4] for b in entry.bytes).decode() == "🌍"
    assert response.choices[0].message.content == "🌍"


@pytest.fixture(scope="module")
def random_qwen(qwen, tmp_path_factory):
    """An untrained one-layer model of Qwen2.5's vocabulary behind the real ``hf`` generator."""
    tokenizer, template = qwen
    config = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True, initializer_range=0.5)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    records = tmp_path_factory.mktemp("random-qwen")
    app = create_app(HFGenerator(model, tokenizer, max_batch_size=8), tokenizer, template,
                     get_parser("auto", tokenizer), MODEL, SessionRecorder(records), ServeSettings(), 4096)
    with running(app) as url:
        yield Served(url, records, tokenizer, template, model)


def test_an_untrained_model_writing_any_bytes_merges_as_ascii_does(random_qwen, tmp_path):
    served, sessions = random_qwen, ["r0", "r1", "r2"]
    for n, session in enumerate(sessions):
        api = OpenAI(base_url=f"{served.url}/sessions/{session}/v1", api_key="k", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "你好，世界 🌍 天气怎么样？"}]
        for turn in range(3):
            response = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0,
                                                   seed=10 * n + turn)
            messages += [{"role": "assistant", "content": response.choices[0].message.content},
                         {"role": "user", "content": "再说一遍 🎉"}]
    # The model wrote tokens that its text does not tokenize back to (which forked these sessions before).
    records = [r for s in sessions for r in read_session(served.records / f"{s}.jsonl")]
    assert any(served.tokenizer.encode(r["choices"][0]["text"]) != r["choices"][0]["token_ids"] for r in records)
    summary = export_sessions(session_files(served.records, sessions), tmp_path / "out.jsonl", served.tokenizer,
                              served.template)
    assert summary["calls"] == 9 and summary["samples"] == 3
    trajectories = list(read_trajectories(tmp_path / "out.jsonl"))
    assert all(t.metrics["turns"] == 3 and t.metrics["template_match"] == 1.0 for t in trajectories)
    kept, _ = check_token_drift(trajectories, served.tokenizer, served.template,
                                get_parser("auto", served.tokenizer), max_drift=0.0)
    assert kept == trajectories


def test_a_served_template_context_is_recorded_and_exported_with_the_session(tmp_path):
    """Qwen3 served with thinking off (``model.chat_template_kwargs``): each chat call records what the template
    rendered with, and the exported session carries it, so it merges and passes the drift guard as served."""
    from trajlab.chat.template import resolve_chat

    tokenizer = load_family_tokenizer("qwen3")
    template, context = resolve_chat(tokenizer, {"enable_thinking": False})
    ids, shown = replies(tokenizer)
    app = create_app(IdsGenerator(ids), tokenizer, template, get_parser("auto", tokenizer), MODEL,
                     SessionRecorder(tmp_path), ServeSettings(), 32768, context=context)
    with running(app) as url:
        messages, _ = talk(url, "qwen3", False, cut(tokenizer))
    records = list(read_session(tmp_path / "qwen3.jsonl"))
    assert all(r["template_context"] == {"kwargs": {"enable_thinking": False}} for r in records)
    assert records[0]["prompts"][0]["text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    summary = export_sessions(session_files(tmp_path), tmp_path / "out.jsonl", tokenizer, template)
    assert summary["samples"] == 1
    (trajectory,) = read_trajectories(tmp_path / "out.jsonl")
    assert trajectory.template_context == {"kwargs": {"enable_thinking": False}}
    assert trajectory.metrics["turns"] == 3 and trajectory.metrics["template_match"] == 1.0
    assert check_token_drift([trajectory], tokenizer, template, get_parser("auto", tokenizer),
                             max_drift=0.0) == ([trajectory], [])
