"""The ``openai`` backend against ``trajlab serve``'s real app on a loopback port.

The tiny model never writes a tool call, so multi-turn episodes are driven by ``FakeToolCaller`` behind the real
app: a scripted fake generator that answers every turn with an arithmetic tool call. ``ignoring_token_ids`` is a
fake of a server without vLLM's ``return_token_ids`` (an older vLLM, a text-only server): it drops the field from
requests before the real app sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import socket
import threading
import time

import pytest

import trajlab
from tests.inference.loopback import JSONHandler, serving
from tests.proxy.conftest import MODEL, running
from trajlab.chat.parsers import get_parser
from trajlab.collection.engines import load_rollout_policy
from trajlab.config import ModelSettings, RolloutSettings, ServeSettings
from trajlab.data.store import read_trajectories
from trajlab.env import load_env
from trajlab.inference.base import GenerationRequest, GenerationResult, SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.inference.openai_client import OpenAIGenerator, ServerError, served_model
from trajlab.models.loading import load_model
from trajlab.proxy import SessionRecorder, create_app
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


class FakeToolCaller:
    """Scripted fake model: every turn calls ``add`` (logprob -0.25 per token), so episodes run several turns."""

    name = "fake"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        turn = self.tokenizer.decode(request.prompt_ids).count("<|im_start|>assistant") - 1
        reply = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {turn}, "b": 2}}}}\n</tool_call><|im_end|>'
        ids = self.tokenizer.encode(reply, add_special_tokens=False)
        return GenerationResult(ids, [-0.25] * len(ids), "stop")


def ignoring_token_ids(app):
    """ASGI wrapper: the request's ``return_token_ids`` is dropped, so replies carry text only."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        data = json.loads(body)
        data.pop("return_token_ids", None)
        body = json.dumps(data).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await app({**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}, replay, send)

    return wrapped


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_server(tiny_model, tiny_tokenizer, tiny_template, tmp_path_factory):
    app = create_app(HFGenerator(tiny_model, tiny_tokenizer, max_batch_size=32), tiny_tokenizer, tiny_template,
                     get_parser("auto", tiny_tokenizer), MODEL, SessionRecorder(tmp_path_factory.mktemp("rec")),
                     ServeSettings(), tiny_tokenizer.model_max_length)
    with running(app) as url:
        yield f"{url}/v1"


def fake_server(tokenizer, template, records, *, token_ids: bool = True):
    app = create_app(FakeToolCaller(tokenizer), tokenizer, template, get_parser("auto", tokenizer), MODEL,
                     SessionRecorder(records), ServeSettings(),
                     tokenizer.model_max_length)
    return running(app if token_ids else ignoring_token_ids(app))


def arithmetic_engine(generator, tokenizer, template, max_new_tokens: int = 48, temperature: float = 0.0):
    return RolloutEngine(load_env("arithmetic"), generator, tokenizer, chat_template=template,
                         parser=get_parser("auto", tokenizer),
                         sampling=SamplingParams(temperature=temperature),
                         limits=dict(max_turns=2, max_new_tokens=max_new_tokens), seed=0)


def episodes(n: int) -> list[Episode]:
    tasks = itertools.islice(load_env("arithmetic").iter_tasks("test", seed=0), n)
    return [Episode(task["task_id"], task) for task in tasks]


def check_tokens(trajectory, tokenizer, template) -> None:
    tokens = trajectory.tokens
    assert len(tokens.completion_ids) == len(tokens.loss_mask) == len(tokens.logprobs)
    rendered = tokenizer.apply_chat_template(trajectory.messages, tools=trajectory.tools, tokenize=False,
                                             chat_template=template)
    assert tokenizer.decode(tokens.prompt_ids + tokens.completion_ids, skip_special_tokens=False) == rendered


def test_greedy_turns_match_the_hf_generator_token_for_token(tiny_server, tiny_model, tiny_tokenizer, tiny_template):
    prompts = [tiny_tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False) for text in ("hello", "add 2 and 3", "what is 7*8?")]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(0, 2))
    remote = OpenAIGenerator(tiny_server, MODEL, tiny_tokenizer)
    local = HFGenerator(tiny_model, tiny_tokenizer, max_batch_size=32)

    async def all_of(generator):  # concurrent, so both sides batch
        return await asyncio.gather(*(generator.generate(GenerationRequest(p, params)) for p in prompts))

    for got, want in zip(asyncio.run(all_of(remote)), asyncio.run(all_of(local)), strict=True):
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert not got.text_only
    assert not remote.text_only


def test_a_greedy_episode_through_the_server_equals_the_local_one(tiny_server, tiny_model, tiny_tokenizer,
                                                                  tiny_template):
    # The untrained tiny model answers in one turn; multi-turn episodes are the next test's.
    remote = arithmetic_engine(OpenAIGenerator(tiny_server, MODEL, tiny_tokenizer), tiny_tokenizer, tiny_template,
                               max_new_tokens=16)
    local = arithmetic_engine(HFGenerator(tiny_model, tiny_tokenizer, max_batch_size=32), tiny_tokenizer, tiny_template,
                              max_new_tokens=16)
    got = sorted(asyncio.run(remote.run(episodes(3), concurrency=8, retries=0, retry_backoff_s=1.0)),
                 key=lambda t: t.id)
    want = sorted(asyncio.run(local.run(episodes(3), concurrency=8, retries=0, retry_backoff_s=1.0)),
                  key=lambda t: t.id)
    for a, b in zip(got, want, strict=True):
        assert a.status != "error", a.error
        assert a.messages == b.messages and a.stop_reason == b.stop_reason
        assert a.tokens.completion_ids == b.tokens.completion_ids and a.tokens.loss_mask == b.tokens.loss_mask
        model = [lp for lp, bit in zip(a.tokens.logprobs, a.tokens.loss_mask, strict=True) if bit]
        assert model == pytest.approx([lp for lp, bit in zip(b.tokens.logprobs, b.tokens.loss_mask, strict=True)
                                       if bit], abs=1e-4)
        assert "text_only" not in a.metrics


def test_multi_turn_rollouts_keep_the_servers_tokens(tiny_tokenizer, tiny_template, tmp_path):
    with fake_server(tiny_tokenizer, tiny_template, tmp_path) as url:
        generator = OpenAIGenerator(f"{url}/v1", MODEL, tiny_tokenizer)
        engine = arithmetic_engine(generator, tiny_tokenizer, tiny_template)
        results = asyncio.run(engine.run(episodes(4), concurrency=8, retries=0, retry_backoff_s=1.0))
    for trajectory in results:
        assert trajectory.status != "error", trajectory.error
        assert trajectory.metrics["turns"] == 2 and trajectory.metrics["tool_calls"] == 2
        check_tokens(trajectory, tiny_tokenizer, tiny_template)
        tokens = trajectory.tokens
        assert [lp for lp, bit in zip(tokens.logprobs, tokens.loss_mask, strict=True) if bit] == \
            [-0.25] * int(trajectory.metrics["model_tokens"])
        assert "text_only" not in trajectory.metrics


def test_a_server_without_token_ids_gives_text_only_trajectories_and_one_warning(tiny_tokenizer, tiny_template,
                                                                                 tmp_path, caplog):
    with fake_server(tiny_tokenizer, tiny_template, tmp_path, token_ids=False) as url:
        generator = OpenAIGenerator(f"{url}/v1", MODEL, tiny_tokenizer)
        with caplog.at_level(logging.WARNING, logger="trajlab.inference.openai_client"):
            engine = arithmetic_engine(generator, tiny_tokenizer, tiny_template)
            results = asyncio.run(engine.run(episodes(3), concurrency=8, retries=0, retry_backoff_s=1.0))
    warnings = [r for r in caplog.records if "returned no token ids" in r.getMessage()]
    assert len(warnings) == 1 and url in warnings[0].getMessage() and generator.text_only
    for trajectory in results:
        assert trajectory.status != "error", trajectory.error
        assert trajectory.metrics["text_only"] == 1.0 and trajectory.metrics["turns"] == 2
        check_tokens(trajectory, tiny_tokenizer, tiny_template)  # re-tokenized text, the stop token put back
        assert all(lp is None for lp in trajectory.tokens.logprobs)


def test_an_unreachable_server_is_a_clear_error(tiny_tokenizer):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    with pytest.raises(ValueError, match=f"cannot reach an OpenAI-compatible server at {url}.*is it running"):
        served_model(url)
    generator = OpenAIGenerator(url, MODEL, tiny_tokenizer, max_retries=0)
    with pytest.raises(ServerError, match=f"cannot reach {url}"):
        asyncio.run(generator.generate(GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=4))))


def test_http_errors_name_the_url_and_the_servers_message(tiny_server, tiny_tokenizer):
    generator = OpenAIGenerator(tiny_server, "no-such-model", tiny_tokenizer, max_retries=0)
    with pytest.raises(ServerError, match=r"/completions answered HTTP 404: .*'no-such-model' does not exist"):
        asyncio.run(generator.generate(GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=4))))


def test_collect_with_a_server_policy(tiny_server, tiny_model_dir, tmp_path):
    env = load_env("arithmetic")
    out = tmp_path / "t.jsonl"
    trajectories = trajlab.collect(env, tiny_server, out=out, episodes=3, tokenizer=str(tiny_model_dir),
                                   split="test", temperature=0.0, rollout={"max_turns": 2, "max_new_tokens": 16})
    assert len(trajectories) == 3 and all(t.status != "error" for t in trajectories)
    stored = list(read_trajectories(out))
    assert len(stored) == 3 and {t.policy for t in stored} == {f"{tiny_server}#{MODEL}"}
    assert all("text_only" not in t.metrics for t in stored)

    def policy(url, tokenizer):
        return load_rollout_policy(env, url, model=ModelSettings(), rollout=RolloutSettings(concurrency=8),
                                   tokenizer=tokenizer, demonstrator=None)

    with pytest.raises(ValueError, match="pass --tokenizer"):
        policy(tiny_server, None)
    assert policy(f"{tiny_server}#{MODEL}", str(tiny_model_dir)).generator.model == MODEL
    with pytest.raises(ValueError, match=r"does not serve 'other'; it serves \['tiny'\]"):
        policy(f"{tiny_server}#other", str(tiny_model_dir))


class Backend(JSONHandler):
    """A loopback OpenAI-compatible server that lists one model and answers ``/completions`` with ``reply`` (bytes,
    HTTP 200), or, when ``reply`` is None, never answers at all (until the test ends)."""

    reply: bytes | None = None
    released = threading.Event()

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.answer(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.reply is None:
            self.released.wait(60)
            return
        self.answer(200, self.reply)


@contextlib.contextmanager
def backend(reply: bytes | None):
    handler = type("Handler", (Backend,), {"reply": reply, "released": threading.Event()})
    with serving(handler) as server:
        try:
            yield f"http://127.0.0.1:{server.server_port}/v1"
        finally:
            handler.released.set()


def completion(**choice) -> bytes:
    return json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": MODEL,
                       "choices": [{"index": 0, "text": "4", "finish_reason": "stop", "logprobs": None} | choice]
                       }).encode()


def one_turn(generator):
    return asyncio.run(generator.generate(GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=4))))


def test_a_server_that_never_answers_fails_the_turn_within_the_timeout(tiny_tokenizer):
    with backend(None) as url:
        generator = OpenAIGenerator(url, MODEL, tiny_tokenizer, turn_timeout_s=1.0)  # retries included
        started = time.monotonic()
        with pytest.raises(ServerError, match=f"{url}/completions did not answer within 1 s "
                                              r"\(rollout.server_timeout_s\)"):
            one_turn(generator)
        assert time.monotonic() - started < 3


def test_a_hanging_server_is_an_error_episode_that_names_it_and_is_retried(tiny_model_dir, tmp_path):
    with backend(None) as url:
        started = time.monotonic()
        [trajectory] = trajlab.collect(load_env("arithmetic"), url, out=tmp_path / "t.jsonl", episodes=1,
                                       tokenizer=str(tiny_model_dir), split="test",
                                       rollout={"server_timeout_s": 1, "retries": 1, "retry_backoff_s": 0})
        elapsed = time.monotonic() - started
    assert trajectory.status == "error" and trajectory.metrics["attempts"] == 2
    assert f"{url}/completions did not answer within 1 s" in trajectory.error
    assert elapsed < 15


GARBAGE = {  # what a broken or hostile server answered -> what the error must say
    "a JSON string": (b'"hello"', "reply: Input should be an object"),
    "no choices": (b'{"foo": 1}', "choices: Field required"),
    "empty choices": (b'{"choices": []}', "choices: List should have at least 1 item"),
    "not JSON": (b"<html>busy</html>", "a body that is not JSON: '<html>busy</html>'"),
    "token ids as text": (completion(token_ids="abc"), "choices.0.token_ids: Input should be a valid array"),
    "a token id as text": (completion(token_ids=[1, "2"]), "choices.0.token_ids.1: Input should be a valid integer"),
    "a negative token id": (completion(token_ids=[-1]), "choices.0.token_ids.0: Input should be greater than or "
                                                        "equal to 0"),
    "logprobs as text": (completion(token_ids=[5], logprobs={"token_logprobs": ["x"]}),
                         "choices.0.logprobs.token_logprobs.0: Input should be a valid number"),
    "text that is no text": (completion(text=5), "choices.0.text: Input should be a valid string"),
}


@pytest.mark.parametrize("case", GARBAGE)
def test_a_garbage_answer_names_the_url_and_what_was_wrong(tiny_tokenizer, case):
    reply, expected = GARBAGE[case]
    with backend(reply) as url, pytest.raises(ServerError, match=re.escape(f"{url}/completions answered ")) as raised:
        one_turn(OpenAIGenerator(url, MODEL, tiny_tokenizer, turn_timeout_s=10, max_retries=0))
    assert expected in str(raised.value)


def test_a_poisoned_answer_is_an_error_row_and_the_store_resumes(tiny_model_dir, tmp_path):
    """``token_ids: "abc"`` was written to the store, and every resume refused the file."""
    out = tmp_path / "t.jsonl"
    with backend(completion(token_ids="abc")) as url:
        def run():
            return trajlab.collect(load_env("arithmetic"), url, out=out, episodes=1, tokenizer=str(tiny_model_dir),
                                   split="test", rollout={"retries": 0})

        [trajectory] = run()
        assert trajectory.status == "error" and "choices.0.token_ids: Input should be a valid array" in trajectory.error
        [again] = run()  # the resume: the error row is run again, not refused
    assert again.status == "error" and [t.id for t in read_trajectories(out)] == [trajectory.id]
