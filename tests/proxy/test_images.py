"""Images in chat requests: `trajlab serve` with the tiny vision-language model takes inline data URLs, gives the
pixels to the model, records them beside the session by id, and `traces export` keeps them, drift guard passing."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import openai
import pytest
from PIL import Image
from typer.testing import CliRunner

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat_template
from trajlab.cli import app
from trajlab.config import ModelSettings, RolloutSettings, ServeSettings
from trajlab.data.store import image_dir, read_trajectories
from trajlab.inference.base import GenerationRequest, GenerationResult
from trajlab.models.loading import load_processor, load_tokenizer
from trajlab.proxy import SessionRecorder, create_app
from trajlab.proxy.errors import APIError
from trajlab.proxy.images import inline_images
from trajlab.proxy.openai_format import to_template_messages
from trajlab.proxy.recording import read_session
from trajlab.proxy.server import build_app
from trajlab.rollout.drift import check_token_drift
from trajlab.rollout.images import decode_png, encode_png

from .conftest import MODEL, Served, running
from .test_app import TOKEN_IDS, as_dict, client

RED, BLUE = (220, 30, 30), (30, 30, 220)


def picture(color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (64, 64), color)
    image.putpixel((3, 5), (0, 255, 0))  # not one flat colour: a lossy format would change some pixels
    return image


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def looking_at(url: str, text: str = "What colour is it?") -> dict:
    return {"role": "user",
            "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}


@pytest.fixture(scope="module")
def vision_server(tiny_vision_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny vision-language model directory, loaded as `trajlab serve --model DIR` loads it."""
    records = tmp_path_factory.mktemp("sessions")
    server = build_app(ServeSettings(served_model_name=MODEL, record_dir=str(records)),
                       ModelSettings(path=str(tiny_vision_dir), device="cpu"), RolloutSettings().parser)
    tokenizer = load_tokenizer(tiny_vision_dir)
    with running(server) as url:
        yield Served(url, records, tokenizer, resolve_chat_template(tokenizer))


def ask(served: Served, session: str, messages: list[dict], **options):
    return client(served.url, session).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, extra_body=TOKEN_IDS, **options)


def test_a_chat_with_an_inline_png_is_answered_and_recorded_with_the_image_beside_it(vision_server) -> None:
    response = ask(vision_server, "png", [looking_at(data_url(picture(RED)))])
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.model_extra["token_ids"]
    soft = vision_server.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert response.model_extra["prompt_token_ids"].count(soft) == 4, "the processor's four image tokens"

    path = vision_server.records / "png.jsonl"
    assert "base64" not in path.read_text(), "the line names the image, never holds its bytes"
    (record,) = read_session(path)
    image_id = encode_png(picture(RED))[0]
    assert record["request"]["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": image_id}}
    assert record["prompts"][0]["images"] == [image_id]
    assert record["prompts"][0]["token_ids"] == response.model_extra["prompt_token_ids"]
    stored = image_dir(path) / image_id
    assert decode_png(stored.read_bytes()).tobytes() == picture(RED).tobytes()


def test_the_pixels_reach_the_model(vision_server) -> None:
    red, blue = (ask(vision_server, "pixels", [looking_at(data_url(picture(color)))]) for color in (RED, BLUE))
    assert red.model_extra["prompt_token_ids"] == blue.model_extra["prompt_token_ids"], "same tokens, other pixels"
    logprobs = [[t.logprob for t in r.choices[0].logprobs.content] for r in (red, blue)]
    assert logprobs[0] != logprobs[1]


@pytest.mark.parametrize("url, says", [
    ("https://example.com/cat.png", "send the image inline as a data URL"),
    ("data:image/png;base64,not*base64!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"no image here").decode(), "holds no image"),
    ("data:text/plain;base64,aGk=", "data URL"),
])
def test_images_that_are_not_inline_or_not_images_get_a_400(vision_server, url: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        ask(vision_server, "refused", [looking_at(url)])
    assert error.value.status_code == 400 and says in error.value.body["message"]
    assert error.value.body["param"] == "messages[0].content[1]"


def test_text_that_holds_the_models_image_token_gets_a_400(vision_server) -> None:
    """It would leave the model more image tokens than image features, failing every request batched with it."""
    for messages in ([looking_at(data_url(picture(RED)), "<image_soft_token>")],
                     [{"role": "user", "content": "<image_soft_token>"}]):
        with pytest.raises(openai.BadRequestError, match="image token"):
            ask(vision_server, "injected", messages)
    soft = vision_server.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    with pytest.raises(openai.BadRequestError, match="image token"):
        client(vision_server.url, "injected").completions.create(model=MODEL, prompt=[soft, soft], max_tokens=2)


def test_a_text_model_refuses_an_image_before_decoding_it_and_records_no_bytes(hf_server, monkeypatch) -> None:
    """Decoding a 25-megapixel image took 200 MB, only to be refused: the refusal comes first, and the record keeps
    what the part held, not its bytes (no model saw them)."""
    decoded = []
    monkeypatch.setattr("trajlab.proxy.local.inline_images", lambda messages: decoded.append(1))
    url = data_url(picture(RED))
    with pytest.raises(openai.BadRequestError, match="reads text only"):
        ask(hf_server, "text-model", [looking_at(url)])
    (record,) = read_session(hf_server.records / "text-model.jsonl")
    assert record["status"] == 400 and not decoded and url not in json.dumps(record)
    part = record["request"]["messages"][0]["content"][1]
    assert part["image_url"]["url"] == f"not kept: {url[:30]}... ({len(url)} characters)"
    assert not image_dir(hf_server.records / "text-model.jsonl").exists()


def test_jpeg_and_webp_become_png_by_id_in_user_and_tool_messages_only() -> None:
    messages = [looking_at(data_url(picture(RED), "JPEG")), looking_at(data_url(picture(BLUE), "WEBP")),
                {"role": "user", "content": "no image"}]
    sent = json.loads(json.dumps(messages))
    inlined, images = inline_images(messages)
    assert messages == sent and inlined[2] is messages[2]
    ids = [m["content"][1]["image_url"]["url"] for m in inlined[:2]]
    assert list(images) == ids and all(decode_png(images[i]).size == (64, 64) for i in ids)
    with pytest.raises(APIError, match="must be"):
        inline_images([{"role": "user", "content": [{"type": "image_url", "image_url": "data:..."}]}])
    system, _ = inline_images([{"role": "system", "content": messages[0]["content"]}])
    with pytest.raises(APIError, match="user and tool messages only"):
        to_template_messages(system)


LOOK = {"type": "function", "function": {"name": "look", "description": "See the next picture."}}


class LookAgain:
    """Calls look() in every reply, keeping each request: a reply the template renders back to the same ids, so
    the next call of a conversation extends it (the random tiny model's replies may not)."""

    name = "look-again"

    def __init__(self, tokenizer) -> None:
        call = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call><|im_end|>'
        self.ids = tokenizer.encode(call, add_special_tokens=False)
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        return GenerationResult(list(self.ids), [-0.5] * len(self.ids), "stop")


def test_traces_export_keeps_the_images_and_passes_the_drift_guard(tiny_vision_dir, tmp_path) -> None:
    tokenizer, processor = load_tokenizer(tiny_vision_dir), load_processor(tiny_vision_dir)
    template = resolve_chat_template(tokenizer)
    generator = LookAgain(tokenizer)
    records = tmp_path / "sessions"
    server = create_app(generator, tokenizer, template, get_parser("auto", tokenizer), MODEL,
                        SessionRecorder(records), ServeSettings(), tokenizer.model_max_length, processor)
    red, blue = data_url(picture(RED)), data_url(picture(BLUE))
    red_id, blue_id = encode_png(picture(RED))[0], encode_png(picture(BLUE))[0]
    with running(server) as url:
        served = Served(url, records, tokenizer, template)
        # A conversation of two calls, the second adding a tool result that holds an image; and one whose second
        # call swaps the first image: the same token ids, other pixels, so it must fork, not extend.
        for session in ("chat", "swapped"):
            messages = [{"role": "system", "content": "Look."}, looking_at(red)]
            reply = ask(served, session, messages, tools=[LOOK]).choices[0]
            assert reply.finish_reason == "tool_calls"
            messages.append(as_dict(reply.message))
            messages.append({"role": "tool", "tool_call_id": reply.message.tool_calls[0].id, "content": [
                {"type": "text", "text": "seen:"}, {"type": "image_url", "image_url": {"url": blue}}]})
            if session == "swapped":
                messages[1] = looking_at(blue)
            ask(served, session, messages, tools=[LOOK])
    assert [[image.getpixel((0, 0)) for image in r.images] for r in generator.requests] == [
        [RED], [RED, BLUE], [RED], [BLUE, BLUE]], "each call's images reach the generator, in order"

    out = tmp_path / "traces.jsonl"
    result = CliRunner().invoke(app, ["traces", "export", "--out", str(out), "--tokenizer", str(tiny_vision_dir),
                                      "--record-dir", str(records)])
    assert result.exit_code == 0, result.output
    trajectories = {t.id: t for t in read_trajectories(out)}
    assert sorted(trajectories) == ["chat:0", "swapped:0", "swapped:1"]
    merged = trajectories["chat:0"]
    assert merged.images == [red_id, blue_id] and merged.metrics["turns"] == 2
    assert merged.metrics["template_match"] == 1.0
    assert merged.messages[1]["content"][1] == {"type": "image", "image": red_id}
    assert merged.messages[3]["content"][1] == {"type": "image", "image": blue_id}
    assert sorted(p.name for p in image_dir(out).iterdir()) == sorted([red_id, blue_id])
    assert merged.image(blue_id).tobytes() == picture(BLUE).tobytes()
    assert trajectories["swapped:1"].images == [blue_id, blue_id]

    kept, drifts = check_token_drift(trajectories.values(), tokenizer, template, get_parser("auto", tokenizer),
                                     processor=processor, max_drift=0.0)
    assert len(kept) == 3 and drifts == []
