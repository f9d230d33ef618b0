"""SFT on trajectories whose tools returned images: from the trajectory file through a saved dataset to every
training forward pass, the model gets the pixels the sampler saw, at the same placeholders; the commands users run
do it end to end and leave a model directory that loads as a vision-language model again."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import trajlab
from trajlab.chat.parsers import get_parser
from trajlab.cli import app
from trajlab.config import SFTSettings
from trajlab.data.datasets import load_saved_dataset, save_dataset, sft_dataset
from trajlab.data.store import TrajectoryStore, image_dir, read_trajectories
from trajlab.env import Environment, load_env
from trajlab.env.base import tool_call_message
from trajlab.env.limits import EpisodeLimits
from trajlab.env.registry import EnvSpec
from trajlab.inference.pixels import image_inputs
from trajlab.inference.policy import load_policy
from trajlab.models.loading import load_model, load_processor
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode
from trajlab.rollout.types import Trajectory
from trajlab.train import sft as sft_training

LOOKS = 3
TOKENS_PER_IMAGE = 4  # the tiny vision model's


def slide(seed: int) -> Image.Image:
    """Noise drawn from ``seed``: any two slides differ in almost every pixel."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))


class Slides(Environment):
    """Shows the task's slides one per look(); answer() ends the episode. Only the title reaches the text."""

    def reset(self, **task: Any) -> str:
        super().reset()
        self.seeds, self.shown = task["seeds"], 0
        return f"Look at the {task['title']} slides one by one, then answer."

    def look(self) -> Image.Image:
        """See the next slide."""
        self.shown += 1
        return slide(self.seeds[self.shown - 1])

    def answer(self, text: str) -> str:
        """Say what the slides showed.

        Args:
            text: a short description
        """
        self.done, self.reward = True, 1.0
        return "Noted."


def look_then_answer(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    if sum(m["role"] == "tool" for m in messages) < LOOKS:
        return tool_call_message("look", {})
    return tool_call_message("answer", {"text": "noise"})


SLIDES = EnvSpec(name="slides", env_cls=Slides, tasks=lambda split, seed=0: iter(()), oracle=look_then_answer,
                 limits=EpisodeLimits(max_turns=LOOKS + 1))
TASKS = {"cats": {"title": "cat", "seeds": [1, 2, 3]}, "dogs": {"title": "dog", "seeds": [4, 5, 6]},
         "dogs again": {"title": "dog", "seeds": [7, 8, 9]}}
"""The two dog tasks render to the same tokens and differ only in their pixels."""


@pytest.fixture(scope="module")
def slides(tiny_vision_dir: Path) -> tuple[Any, dict[str, Trajectory]]:
    policy = load_policy("oracle", tokenizer=tiny_vision_dir, oracle=look_then_answer, device="auto", dtype="auto",
                         backend="hf", max_batch_size=32)
    with RolloutEngine(SLIDES, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                       parser=get_parser("auto", policy.tokenizer), processor=policy.processor, seed=0) as engine:
        done = asyncio.run(engine.run([Episode(id=name, task=task) for name, task in TASKS.items()], concurrency=8,
                                      retries=0, retry_backoff_s=1.0))
    assert [t.status for t in done] == ["success"] * len(TASKS)
    return policy, {t.id: t for t in done}


def _settings(**overrides: Any) -> SFTSettings:
    return SFTSettings(**({"max_steps": 1, "batch_size": 2, "warmup_steps": 0, "logging_steps": 1} | overrides))


def test_each_training_forward_gets_its_rows_images_at_their_placeholders(slides, tiny_vision_dir, tmp_path,
                                                                          monkeypatch) -> None:
    policy, by_name = slides
    path = tmp_path / "slides.jsonl"
    with TrajectoryStore(path) as store:
        for name in ("cats", "dogs"):
            store.append(by_name[name])
    trajectories = {t.id: t for t in read_trajectories(path)}
    for name, t in trajectories.items():  # one image per tool turn, in turn order: the task's slides
        tool_images = [m["content"][0]["image"] for m in t.messages if m.get("name") == "look"]
        assert tool_images == t.images and len(set(t.images)) == LOOKS
        assert [np.asarray(t.image(i)).tolist() for i in t.images] == [
            np.asarray(slide(seed)).tolist() for seed in TASKS[name]["seeds"]]
    seen = {name: [t.image(i) for i in t.images] for name, t in trajectories.items()}
    saved = save_dataset(sft_dataset(trajectories.values(), include_failures=False, shortest_per_task=False),
                         tmp_path / "sft")
    shutil.rmtree(image_dir(path))  # the saved dataset holds the images itself

    model, processor = load_model(tiny_vision_dir), load_processor(tiny_vision_dir)
    batches: list[dict[str, Any]] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: batches.append(kwargs), with_kwargs=True)
    losses: list[dict[str, Any]] = []  # the loss's inputs: its labels (the forward gets none: the loss is sliced)
    sliced = sft_training.sliced_sft_loss

    def recorded(model: Any, inputs: dict[str, Any], count: Any) -> Any:
        losses.append(inputs)
        return sliced(model, inputs, count)

    monkeypatch.setattr(sft_training, "sliced_sft_loss", recorded)
    trajlab.sft(model, load_saved_dataset(saved), tmp_path / "out", tokenizer=policy.tokenizer, processor=processor,
                device="cpu", **_settings().model_dump())

    batch = batches[0]
    ids = batch["input_ids"]  # (2, L)
    rows = [next(n for n, t in trajectories.items() if row[:len(t.tokens.prompt_ids)] == t.tokens.prompt_ids)
            for row in ids.tolist()]  # which episode each row is (their prompts differ by the title)
    assert sorted(rows) == ["cats", "dogs"]
    expected = image_inputs(model, processor, [image for name in rows for image in seen[name]], ids)
    assert batch["pixel_values"].shape == (2 * LOOKS, 3, 64, 64)
    assert torch.equal(batch["pixel_values"], expected["pixel_values"]), "each row's slides, in placeholder order"
    image_token = model.config.image_token_id
    assert ((ids == image_token).sum(dim=1) == LOOKS * TOKENS_PER_IMAGE).all()
    assert torch.equal(batch["token_type_ids"], (ids == image_token).long())
    labels = losses[0]["labels"]
    assert torch.equal(losses[0]["input_ids"], ids)
    assert (labels[ids == image_token] == -100).all(), "image tokens are observations"
    for row, name in enumerate(rows):
        tokens = trajectories[name].tokens
        whole, mask = tokens.prompt_ids + tokens.completion_ids, [0] * len(tokens.prompt_ids) + tokens.loss_mask
        assert ids[row, :len(whole)].tolist() == whole
        assert labels[row, :len(whole)].tolist() == [token if bit else -100 for token, bit in zip(whole, mask,
                                                                                                 strict=True)]
        assert (labels[row, len(whole):] == -100).all() and batch["attention_mask"][row].sum() == len(whole)


def test_the_training_loss_depends_on_the_pixels(slides, tiny_vision_dir, tmp_path) -> None:
    """Two datasets the same but for the pixels of their images: if the images never reached the forward pass, the
    first step's loss would be the same for both."""
    policy, by_name = slides
    dog, other_dog = by_name["dogs"], by_name["dogs again"]
    assert dog.tokens == other_dog.tokens and set(dog.images).isdisjoint(other_dog.images)
    processor = load_processor(tiny_vision_dir)

    def first_loss(trajectory: Trajectory, out: str) -> float:
        trajlab.sft(tiny_vision_dir, sft_dataset([trajectory], include_failures=False, shortest_per_task=False),
                    tmp_path / out, tokenizer=policy.tokenizer,
                    processor=processor, device="cpu", **_settings(batch_size=1).model_dump())
        return json.loads((tmp_path / out / "metrics.jsonl").read_text().splitlines()[0])["loss/sft"]

    loss = first_loss(dog, "dog")
    assert first_loss(dog, "dog-again") == loss, "training is deterministic: a difference comes from the pixels"
    assert first_loss(other_dog, "other-dog") != loss


def test_sft_needs_the_processor_for_images(slides, tiny_vision_dir, tmp_path) -> None:
    """A loaded model brings no processor of its own (a model directory's is loaded with it)."""
    policy, by_name = slides
    with pytest.raises(ValueError, match="processor"):
        trajlab.sft(load_model(tiny_vision_dir, device="cpu"), sft_dataset([by_name["cats"]], include_failures=False,
                                                                           shortest_per_task=False), tmp_path,
                    tokenizer=policy.tokenizer, **_settings().model_dump())


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_the_cli_fine_tunes_a_vision_model_on_odd_one_out(tiny_vision_dir, tmp_path) -> None:
    demos, run = tmp_path / "demos.jsonl", tmp_path / "run"
    collected = invoke("collect", "--env", "odd_one_out", "--policy", "oracle", "--tokenizer", tiny_vision_dir,
                       "--episodes", 4, "--out", demos)
    assert collected.exit_code == 0, collected.stdout
    refused = invoke("dataset", "--kind", "sft", "--from", demos, "--out", tmp_path / "sft.jsonl")
    assert refused.exit_code == 1 and "JSON Lines cannot hold" in refused.stdout
    built = invoke("dataset", "--kind", "sft", "--from", demos, "--out", tmp_path / "sft.parquet")
    assert built.exit_code == 0, built.stdout

    trained = invoke("sft", "--model", tiny_vision_dir, "--from", demos, "--out", run, "--max-steps", 2,
                     "--batch-size", 2)
    assert trained.exit_code == 0, trained.stdout
    final = run / "final"
    assert type(load_model(final)).__name__ == "Gemma3ForConditionalGeneration"
    assert type(load_processor(final)).__name__ == "Gemma3Processor"
    assert len(json.loads((run / "metrics.jsonl").read_text().splitlines()[0])) > 1
    # The trained directory is a vision-language model again: it trains on the saved dataset of the same episodes.
    again = invoke("sft", "--model", final, "--data", tmp_path / "sft.parquet", "--out", tmp_path / "again",
                   "--max-steps", 1, "--batch-size", 2)
    assert again.exit_code == 0, again.stdout


def test_a_text_only_run_of_a_vision_model_keeps_its_processor(tiny_vision_dir, tmp_path) -> None:
    spec = load_env("arithmetic")
    policy = load_policy("oracle", tokenizer=tiny_vision_dir, oracle=spec.oracle, device="auto", dtype="auto",
                         backend="hf", max_batch_size=32)
    with RolloutEngine(spec, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                       parser=get_parser("auto", policy.tokenizer), processor=policy.processor, seed=0) as engine:
        tasks = itertools.islice(spec.iter_tasks("train", seed=0), 2)
        demos = asyncio.run(engine.run([Episode(id=t["task_id"], task=t) for t in tasks], concurrency=8, retries=0,
                                       retry_backoff_s=1.0))
    final = trajlab.sft(tiny_vision_dir, demos, tmp_path, max_steps=1, batch_size=2, warmup_steps=0, device="cpu")
    assert type(load_processor(final)).__name__ == "Gemma3Processor"
