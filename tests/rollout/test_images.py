"""Images from tools, through the engine: kept as PNG bytes by id, turned into the model's image tokens by its
processor, handed to the sampler, stored beside the trajectory file, and checked by the drift guard."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import ChatTemplate
from trajlab.data.store import TrajectoryStore, image_dir, read_trajectories
from trajlab.env import Environment
from trajlab.env.builtin.odd_one_out import SPEC as ODD_ONE_OUT
from trajlab.env.content import tool_content
from trajlab.env.registry import EnvSpec
from trajlab.inference.base import GenerationRequest, GenerationResult, SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.inference.policy import load_policy
from trajlab.models.loading import load_model, load_processor
from trajlab.rollout.drift import check_token_drift
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.images import decode_png, encode_png
from trajlab.rollout.runner import Episode

RED = Image.new("RGB", (64, 64), (220, 30, 30))


def test_tools_may_return_images_in_every_natural_form() -> None:
    array = np.zeros((8, 8, 3), dtype=np.uint8)
    for value in (RED, encode_png(RED)[1], array, [RED], ["a caption", {"type": "image", "image": RED}]):
        content = tool_content(value)
        assert isinstance(content, list) and any(part["type"] == "image" for part in content), value
        assert all(part["image"].mode == "RGB" for part in content if part["type"] == "image")
    assert tool_content(["a", "b"]) == "['a', 'b']" and tool_content(b"not an image") == "b'not an image'"
    assert tool_content(["x", RED])[0] == {"type": "text", "text": "x"}


def _engine(env: EnvSpec, policy: Any, **options: Any) -> RolloutEngine:
    return RolloutEngine(env, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                         parser=get_parser("auto", policy.tokenizer), seed=0, processor=policy.processor, **options)


@pytest.fixture(scope="module")
def oracle_run(tiny_vision_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    policy = load_policy("oracle", tokenizer=tiny_vision_dir, oracle=ODD_ONE_OUT.oracle, device="auto", dtype="auto",
                         backend="hf", max_batch_size=32)
    task = next(ODD_ONE_OUT.tasks("train", seed=0))
    with _engine(ODD_ONE_OUT, policy) as engine:
        trajectory = asyncio.run(engine.run_episode(Episode(id="e0", task=task)))
    path = tmp_path_factory.mktemp("store") / "trajectories.jsonl"
    with TrajectoryStore(path) as store:
        store.append(trajectory)
    return policy, path


def test_an_image_from_a_tool_becomes_the_processors_image_tokens_not_trained(oracle_run, tiny_vision_dir) -> None:
    policy, path = oracle_run
    trajectory = next(read_trajectories(path))
    assert trajectory.status == "success" and len(trajectory.images) == 1
    tool = next(m for m in trajectory.messages if m["role"] == "tool")
    assert tool["content"] == [{"type": "image", "image": trajectory.images[0]}]
    tokens = trajectory.tokens
    ids = tokens.prompt_ids + tokens.completion_ids
    soft = policy.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    image_positions = [i for i, token in enumerate(ids) if token == soft]
    assert len(image_positions) == 4, "Gemma 3's four image tokens for the one image"
    trained = [0] * len(tokens.prompt_ids) + tokens.loss_mask
    assert not any(trained[i] for i in image_positions), "image tokens are observations: loss mask 0"
    # decode(prompt + completion) equals the processor's rendering of the messages, images expanded.
    chat = ChatTemplate(policy.tokenizer, trajectory.tools, policy.chat_template, policy.processor)
    rendered = chat.render(trajectory.messages)
    expanded = policy.processor(text=rendered, images=[trajectory.image(i) for i in trajectory.images],
                                add_special_tokens=False)["input_ids"][0]
    assert policy.tokenizer.decode(ids, skip_special_tokens=False) == policy.tokenizer.decode(expanded)


def test_images_live_beside_the_file_once_and_come_back_as_the_same_bytes(oracle_run) -> None:
    _, path = oracle_run
    line = path.read_text()
    assert len(line) < 20_000 and "base64" not in line, "images are referenced, never inlined"
    trajectory = next(read_trajectories(path))
    stored = image_dir(path) / trajectory.images[0]
    assert sorted(p.name for p in image_dir(path).iterdir()) == [trajectory.images[0]]
    image = decode_png(stored.read_bytes())
    assert encode_png(image)[0] == trajectory.images[0], "the id is the hash of the PNG bytes"
    assert np.array_equal(np.asarray(trajectory.image(trajectory.images[0])), np.asarray(image))


def test_the_drift_guard_replays_image_tokens_and_needs_the_processor(oracle_run) -> None:
    policy, path = oracle_run
    trajectories = list(read_trajectories(path))
    parser = get_parser("auto", policy.tokenizer)
    kept, drifts = check_token_drift(trajectories, policy.tokenizer, policy.chat_template, parser,
                                     processor=policy.processor, max_drift=0.0)
    assert len(kept) == 1 and drifts == []
    with pytest.raises(ValueError, match="text model"):
        check_token_drift(trajectories, policy.tokenizer, policy.chat_template, parser, max_drift=0.0)


def test_a_text_model_refuses_an_episode_that_shows_it_an_image(tiny_model_dir) -> None:
    policy = load_policy("oracle", tokenizer=tiny_model_dir, oracle=ODD_ONE_OUT.oracle, device="auto", dtype="auto",
                         backend="hf", max_batch_size=32)
    with _engine(ODD_ONE_OUT, policy) as engine:
        trajectory = asyncio.run(engine.run_episode(Episode(id="e", task=next(ODD_ONE_OUT.tasks("train", seed=0)))))
    assert trajectory.status == "error" and "vision-language model" in trajectory.error


class Camera(Environment):
    """Shows one image per call to look(); which one the task says."""

    def reset(self, **task: Any) -> str:
        self.colors = task["colors"]
        self.shown = 0
        return "Look three times."

    def look(self) -> Image.Image:
        """See the next picture."""
        color = self.colors[self.shown]
        self.shown += 1
        return Image.new("RGB", (64, 64), tuple(color))


CAMERA = EnvSpec(name="camera", env_cls=Camera, tasks=lambda split, seed=0: iter(()))


class LookThenModel:
    """Calls look() (the template's own tokens) until it saw ``looks`` images, then lets the model generate."""

    name = "look-then-model"

    def __init__(self, chat: ChatTemplate, model: HFGenerator, looks: int) -> None:
        self.chat, self.model, self.looks = chat, model, looks
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        if len(request.images) < self.looks:
            call = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "look", "arguments": {}}}]}
            chat = self.chat.with_tools(request.tools)
            ids = chat.encode(chat.assistant_text(request.messages, call))
            return GenerationResult(ids, [None] * len(ids), "stop")
        return await self.model.generate(request)


def _camera_run(vision_dir: Path, colors: list[list[int]], looks: int) -> tuple[Any, LookThenModel]:
    policy = load_policy(vision_dir, device="cpu", dtype="auto", backend="hf", max_batch_size=32)
    model = HFGenerator(load_model(vision_dir), policy.tokenizer, processor=load_processor(vision_dir),
                        max_batch_size=32)
    generator = LookThenModel(ChatTemplate(policy.tokenizer, [], policy.chat_template), model, looks)
    engine = RolloutEngine(CAMERA, generator, policy.tokenizer, chat_template=policy.chat_template,
                           parser=get_parser("auto", policy.tokenizer), processor=policy.processor,
                           sampling=SamplingParams(temperature=0.0), limits={"max_turns": looks + 1,
                                                                             "max_new_tokens": 4}, seed=0)
    with engine:
        trajectory = asyncio.run(engine.run_episode(Episode(id="cam", task={"colors": colors})))
    return trajectory, generator


def test_changing_a_tools_image_changes_the_models_logits_at_the_next_turn(tiny_vision_dir) -> None:
    red, blue = [220, 30, 30], [30, 30, 220]
    first, _ = _camera_run(tiny_vision_dir, [red], looks=1)
    second, _ = _camera_run(tiny_vision_dir, [blue], looks=1)
    turns = [t.tokens.completion_ids for t in (first, second)]
    assert first.images != second.images
    # Everything before the model's own turn is the same but the image's pixels; its logprobs differ.
    lp_first = [lp for lp in first.tokens.logprobs if lp is not None]
    lp_second = [lp for lp in second.tokens.logprobs if lp is not None]
    assert lp_first and lp_second
    assert turns[0] != turns[1] or lp_first != lp_second, "the pixels never reached the model"


def test_each_turn_gets_every_image_so_far_in_order(tiny_vision_dir) -> None:
    colors = [[255, 0, 0], [0, 255, 0], [0, 0, 255]]
    trajectory, generator = _camera_run(tiny_vision_dir, colors, looks=3)
    assert [len(r.images) for r in generator.requests] == [0, 1, 2, 3]
    last = generator.requests[-1]
    assert [image.getpixel((0, 0)) for image in last.images] == [tuple(c) for c in colors]
    soft = generator.chat.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert last.prompt_ids.count(soft) == 12 and len(trajectory.images) == 3
    json.dumps(trajectory.model_dump(mode="json"))  # the record holds ids, never PIL images
