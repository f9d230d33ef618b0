"""RL on episodes that show a vision-language model an image: the update's forward passes get the pixels the
sampler got, so the trainer's logprob of every sampled token equals the sampler's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image

import trajlab
from trajlab.config import RLSettings, RolloutSettings
from trajlab.data.store import image_dir, read_trajectories
from trajlab.env import Environment
from trajlab.env.registry import EnvSpec
from trajlab.models.loading import load_model, load_processor, load_tokenizer

COLORS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


class Snapshot(Environment):
    """The first message shows a colour; the model names it."""

    def reset(self, **task: Any) -> list:
        self.color = task["color"]
        return ["Which colour is this?", Image.new("RGB", (64, 64), COLORS[self.color])]

    def answer(self, color: str) -> str:
        """Name the colour.

        Args:
            color: red, green or blue
        """
        self.done = True
        self.reward = float(color == self.color)
        return "Right." if self.reward else "Wrong."


def _tasks(split: str, seed: int = 0):
    while True:
        yield from ({"task_id": name, "color": name} for name in COLORS)


SNAPSHOT = EnvSpec(name="snapshot", env_cls=Snapshot, tasks=_tasks)


def _run(vision_dir: Path, out: Path, **overrides: Any) -> Path:
    tokenizer = load_tokenizer(vision_dir)
    settings = RLSettings(**({"steps": 1, "tasks_per_step": 2, "group_size": 2, "minibatch_size": 4,
                              "save_steps": 1, "learning_rate": 1e-4, "kl_coef": 0.01} | overrides))
    rollout = RolloutSettings(max_turns=1, max_new_tokens=8, concurrency=4)
    return trajlab.rl(vision_dir, SNAPSHOT, out, tokenizer=tokenizer, rollout=rollout, device="cpu",
                      processor=load_processor(vision_dir), **settings.model_dump())


def test_the_update_sees_the_pixels_the_sampler_saw(tiny_vision_dir, tmp_path) -> None:
    final = _run(tiny_vision_dir, tmp_path)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["mismatch/abs_logprob"] < 1e-4, record
    rollouts = list(read_trajectories(tmp_path / "rollouts.jsonl"))
    assert len(rollouts) == 4 and all(len(t.images) == 1 for t in rollouts)
    assert {t.images[0] for t in rollouts} <= {p.name for p in image_dir(tmp_path / "rollouts.jsonl").iterdir()}
    compared = 0
    for trajectory in rollouts:
        tokens = trajectory.tokens
        for sampled, trained, bit in zip(tokens.logprobs, tokens.trainer_logprobs or [], tokens.loss_mask,
                                         strict=False):
            if bit:
                assert abs(trained - sampled) < 1e-4
                compared += 1
    assert compared > 0
    assert load_processor(final) is not None and type(load_model(final)).__name__.endswith("ConditionalGeneration")
