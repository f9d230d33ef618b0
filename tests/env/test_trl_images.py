"""Images from an env inside TRL's GRPOTrainer, through ``trl_environment_factory``, with the tiny vision model.

TRL shows a vision-language model an image only as a content block (``{"type": "image", "image": <PIL image>}``).
A first observation's image trains end to end, and so does a tool's: it reaches the model's ``generate`` as pixels
and image tokens, and the update's forward pass too. TRL 1.16's tool-image path calls the image processor itself and
passes all it returns to the model, including Gemma 3's ``num_crops``, which ``generate`` refuses:
``trl_processing_class`` gives it only the model's inputs.
"""

from __future__ import annotations

import asyncio
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.utils import get_json_schema

from trajlab.env import Environment, load_env
from trajlab.env.base import tool_names, tool_schemas
from trajlab.env.builtin.odd_one_out import IMAGE_PX
from trajlab.env.registry import EnvSpec
from trajlab.env.trl import env_reward, trl_dataset, trl_environment_factory, trl_processing_class
from trajlab.models.loading import load_model, load_processor
from trajlab.models.tiny_vision import TINY_VL_IMAGE_TOKENS, TINY_VL_TOKENS_PER_IMAGE

EPISODES = 2
LOOK_CALL = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call><|im_end|>'


def test_the_trl_class_keeps_the_tools_and_gives_images_as_content_blocks() -> None:
    spec = load_env("odd_one_out")
    cls = trl_environment_factory(spec)
    assert issubclass(cls, spec.env_cls) and cls.__name__ == spec.env_cls.__name__
    assert trl_environment_factory(spec.env_cls) is cls, "one class per env class"
    assert tool_names(cls) == tool_names(spec.env_cls) and tool_schemas(cls) == spec.tools
    env, original = cls(), spec.env_cls()
    # TRL derives each schema from the bound method (get_json_schema), so those must match too.
    for name in tool_names(cls):
        assert get_json_schema(getattr(env, name)) == get_json_schema(getattr(original, name))
    task = next(spec.iter_tasks("train", seed=0))
    assert env.reset(**task) == original.reset(**task)
    [part] = env.look()
    assert part["type"] == "image" and part["image"].size == (IMAGE_PX, IMAGE_PX)
    assert part["image"].tobytes() == original.look().tobytes()
    assert env.answer(task["odd_row"], task["odd_col"]) == "Correct."
    assert env_reward([env]) == [1.0]


class Shapes(Environment):
    """Tools of every kind a trajlab env may have: a staticmethod, a coroutine, a text tool."""

    def reset(self, **task: Any) -> None:
        super().reset()

    @staticmethod
    def png() -> bytes:
        """An encoded image."""
        buffer = io.BytesIO()
        Image.new("RGB", (4, 4), (255, 0, 0)).save(buffer, format="PNG")
        return buffer.getvalue()

    async def pixels(self, side: int) -> np.ndarray:
        """An image as an array.

        Args:
            side: its width and height
        """
        return np.zeros((side, side, 3), dtype=np.uint8)

    def count(self) -> int:
        """A number, shown as text."""
        return 3


def test_staticmethod_coroutine_and_text_tools_stay_what_they_are() -> None:
    cls = trl_environment_factory(Shapes)
    env = cls()
    assert env.reset() is None
    assert isinstance(vars(cls)["png"], staticmethod) and cls.png()[0]["image"].size == (4, 4)
    assert asyncio.iscoroutinefunction(env.pixels)
    assert asyncio.run(env.pixels(side=2))[0]["image"].size == (2, 2)
    assert env.count() == "3"


def _config(out: Path, max_completion_length: int) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", max_steps=1,
        per_device_train_batch_size=EPISODES, num_generations=2, max_completion_length=max_completion_length,
        logging_steps=1, generation_kwargs={"max_new_tokens": 4}, max_tool_calling_iterations=1, disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=False,
    )


@dataclass
class Step:
    """What one GRPOTrainer step showed the model."""

    generate_calls: list[dict[str, Any]] = field(default_factory=list)  # each call's keyword arguments
    pixels_seen: list[tuple[int, ...]] = field(default_factory=list)  # the vision tower's input shapes, in order
    completion_ids: list[list[int]] = field(default_factory=list)
    global_step: int = 0
    error: Exception | None = None


def _run_step(spec: EnvSpec, vision_dir: Path, out: Path, *, max_completion_length: int,
              first_turn: str | None = None) -> Step:
    """One GRPOTrainer step on the env's TRL class; ``first_turn`` replaces the first generation (the random model
    never calls a tool by itself), as a model that learned to call it would write it."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOTrainer

    step = Step()
    processor, model = load_processor(vision_dir), load_model(vision_dir)
    model.model.vision_tower.register_forward_pre_hook(
        lambda _module, _args, kwargs: step.pixels_seen.append(tuple(kwargs["pixel_values"].shape)), with_kwargs=True)
    real_generate = model.generate

    def generate(**kwargs: Any) -> torch.Tensor:
        step.generate_calls.append(kwargs)
        if first_turn is None or len(step.generate_calls) > 1:
            return real_generate(**kwargs)
        input_ids = kwargs["input_ids"]
        scripted = torch.tensor(processor.tokenizer.encode(first_turn, add_special_tokens=False))
        return torch.cat([input_ids, scripted.expand(len(input_ids), -1)], dim=1)

    model.generate = generate

    def recording_reward(environments: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        step.completion_ids.extend(completion_ids)
        return env_reward(environments, **kwargs)

    trainer = GRPOTrainer(model=model, reward_funcs=[recording_reward], args=_config(out, max_completion_length),
                          train_dataset=trl_dataset(spec, split="train", size=4, seed=0),
                          processing_class=trl_processing_class(processor, model),
                          environment_factory=trl_environment_factory(spec))
    try:
        trainer.train()
    except Exception as exc:  # kept for the tests to judge: the known TRL failure, or a new one
        step.error = exc
    step.global_step = trainer.state.global_step
    return step


def _image_token(vision_dir: Path) -> int:
    return load_processor(vision_dir).tokenizer.convert_tokens_to_ids(TINY_VL_IMAGE_TOKENS["image_token"])


class Snapshot(Environment):
    """The first observation is an image alone; the model names its colour."""

    def reset(self, **task: Any) -> Image.Image:
        super().reset()
        self.color = task["color"]
        return Image.new("RGB", (IMAGE_PX, IMAGE_PX), (220, 30, 30) if self.color == "red" else (30, 30, 220))

    def answer(self, color: str) -> str:
        """Name the colour.

        Args:
            color: red or blue
        """
        self.done, self.reward = True, float(color == self.color)
        return "Right." if self.reward else "Wrong."


def _snapshot_tasks(split: str, seed: int = 0):
    while True:
        yield from ({"task_id": color, "color": color} for color in ("red", "blue"))


def test_a_first_observation_image_trains_in_a_trl_step(tiny_vision_dir, tmp_path) -> None:
    spec = EnvSpec(name="snapshot", env_cls=Snapshot, tasks=_snapshot_tasks)
    step = _run_step(spec, tiny_vision_dir, tmp_path, max_completion_length=8)
    if step.error is not None:
        raise step.error
    assert step.global_step == 1
    image = (3, IMAGE_PX, IMAGE_PX)
    # The sampler's prefill and the update's forward pass each encode one image per episode.
    assert step.pixels_seen == [(EPISODES, *image), (EPISODES, *image)]
    image_token = _image_token(tiny_vision_dir)
    first = step.generate_calls[0]["input_ids"]
    assert (first == image_token).sum(dim=1).tolist() == [TINY_VL_TOKENS_PER_IMAGE] * EPISODES


@pytest.fixture(scope="module")
def tool_image_step(tiny_vision_dir, tmp_path_factory) -> Step:
    """One step of odd_one_out whose first turn calls ``look``."""
    return _run_step(load_env("odd_one_out"), tiny_vision_dir, tmp_path_factory.mktemp("trl-odd"),
                     max_completion_length=64, first_turn=LOOK_CALL)


def test_trl_hands_a_tool_image_to_the_model_as_pixels_and_image_tokens(tool_image_step, tiny_vision_dir) -> None:
    assert len(tool_image_step.generate_calls) == 2, "a generation follows the tool's answer"
    after_tool = tool_image_step.generate_calls[1]
    assert after_tool.get("pixel_values") is not None, "the tool's image reached generate as pixels"
    assert tuple(after_tool["pixel_values"].shape) == (EPISODES, 3, IMAGE_PX, IMAGE_PX)
    image_token = _image_token(tiny_vision_dir)
    tokens_per_episode = (after_tool["input_ids"] == image_token).sum(dim=1).tolist()
    assert tokens_per_episode == [TINY_VL_TOKENS_PER_IMAGE] * EPISODES, "the image, not its str(), follows the call"


def test_a_trl_step_trains_on_a_tool_image(tool_image_step, tiny_vision_dir) -> None:
    """With trl_processing_class: TRL 1.16 passes all its image processor returns to the model (Gemma 3's
    ``num_crops`` made ``generate`` refuse the step)."""
    if tool_image_step.error is not None:
        raise tool_image_step.error
    assert tool_image_step.global_step == 1
    image_token = _image_token(tiny_vision_dir)
    assert [ids.count(image_token) for ids in tool_image_step.completion_ids] == [TINY_VL_TOKENS_PER_IMAGE] * EPISODES
    # The generation after the tool and the update's forward pass each encode one image per episode.
    assert tool_image_step.pixels_seen == [(EPISODES, 3, IMAGE_PX, IMAGE_PX)] * 2
