"""Odd one out: a grid of identical shapes but one, shown only as an image; name the odd cell.

Why: the decisive information arrives only as pixels. No text the model reads (the first observation, the tool
descriptions, the other tool results) says where the odd cell is, so a policy blind to images finds it only by
chance, 1 in 9 or 1 in 16: an env for teaching a vision-language model to look before it answers.

A task is a square grid of 3x3 or 4x4 cells (the difficulty knob; a tasks file may give 2x2 to 8x8) holding one
shape in one colour, except the odd cell, whose shape or whose colour differs. ``look()`` returns the grid as a
64x64 RGB PIL image: the tiny vision model's input size, and a handful of image tokens for models whose token count
grows with the pixels (Qwen-VL). ``answer(row, col)`` ends the episode with reward 1 for the odd cell and 0 for any
other, read from the env's state. Rows and columns count from 1 at the top left. Splits: about 70% train, 10%
validation and 20% test, by the hash of the task id. The reference policy reads the odd cell from the task (the
state the image is drawn from): it looks once, then answers.

Pillow is the ``vision`` extra; without it, ``trajlab envs`` lists this env as unavailable with the install command.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

from trajlab.env.base import Environment, tool_call_message
from trajlab.env.builtin._split import split_of
from trajlab.env.limits import EpisodeLimits
from trajlab.env.registry import EnvSpec
from trajlab.errors import require

require("PIL", feature="The odd_one_out environment (its look tool returns an image)",
        install="pip install 'trajlab[vision]'")

from PIL import Image, ImageDraw  # noqa: E402 (after the check that names the extra to install)

IMAGE_PX = 64
GRID_SIZES = (3, 4)  # of the generated tasks; a tasks file may hold others up to MAX_GRID_SIZE
MAX_GRID_SIZE = IMAGE_PX // 8  # cells of 8 pixels at least, so a shape stays recognisable
SHAPES = ("circle", "square", "triangle", "diamond")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 50, 47),
    "blue": (38, 110, 210),
    "green": (40, 160, 70),
    "orange": (240, 150, 20),
    "purple": (140, 70, 180),
}
BACKGROUND = (255, 255, 255)


class OddOneOut(Environment):
    """Find the one cell of a grid of shapes that differs from the others, seen only in an image."""

    def reset(self, **task: Any) -> str:
        super().reset()
        self.size = int(task["size"])
        self.shape, self.color = str(task["shape"]), str(task["color"])
        self.odd = (int(task["odd_row"]), int(task["odd_col"]))
        self.odd_shape, self.odd_color = str(task["odd_shape"]), str(task["odd_color"])
        if not 2 <= self.size <= MAX_GRID_SIZE:
            raise ValueError(f"A grid has 2x2 to {MAX_GRID_SIZE}x{MAX_GRID_SIZE} cells, not {self.size}x{self.size}.")
        unknown = ({self.shape, self.odd_shape} - set(SHAPES)) | ({self.color, self.odd_color} - set(COLORS))
        if unknown:
            raise ValueError(f"Unknown shape or colour {sorted(unknown)}; shapes: {', '.join(SHAPES)}; colours: "
                             f"{', '.join(COLORS)}.")
        if not all(1 <= i <= self.size for i in self.odd):
            raise ValueError(f"The odd cell {self.odd} is outside the {self.size}x{self.size} grid.")
        if (self.odd_shape, self.odd_color) == (self.shape, self.color):
            raise ValueError("The odd cell must differ from the others in shape or colour.")
        self.metrics = {"looks": 0}
        return (
            f"A {self.size}x{self.size} grid holds the same shape in the same colour in every cell but one, which "
            f"differs in shape or colour. Rows and columns are numbered 1 to {self.size} from the top left. Call "
            "look to see the grid, then answer with the row and column of the odd cell."
        )

    def look(self) -> Image.Image:
        """Look at the grid: returns an image of it."""
        self.metrics["looks"] += 1
        return render(self.size, self.shape, self.color, self.odd, self.odd_shape, self.odd_color)

    def answer(self, row: int, col: int) -> str:
        """Name the odd cell; ends the episode.

        Args:
            row: the odd cell's row, 1 at the top
            col: the odd cell's column, 1 at the left
        """
        if self.done:
            return "The episode is over."
        if not (1 <= row <= self.size and 1 <= col <= self.size):
            return f"Error: rows and columns are numbered 1 to {self.size}; got row {row}, column {col}."
        self.done = True
        self.success = (row, col) == self.odd
        self.reward = 1.0 if self.success else 0.0
        return "Correct." if self.success else "Wrong."


def render(size: int, shape: str, color: str, odd: tuple[int, int], odd_shape: str, odd_color: str) -> Image.Image:
    """The grid as an IMAGE_PX-square RGB image; a pure function of the task, so the same task draws the same pixels.

    Cells are ``IMAGE_PX // size`` pixels square, the grid centred (a 3x3 grid leaves a 1-pixel margin).
    """
    image = Image.new("RGB", (IMAGE_PX, IMAGE_PX), BACKGROUND)
    draw = ImageDraw.Draw(image)
    cell = IMAGE_PX // size
    margin = (IMAGE_PX - cell * size) // 2
    pad = cell // 5
    for row, col in itertools.product(range(1, size + 1), repeat=2):
        left, top = margin + (col - 1) * cell + pad, margin + (row - 1) * cell + pad
        box = (left, top, left + cell - 1 - 2 * pad, top + cell - 1 - 2 * pad)
        this_shape, this_color = (odd_shape, odd_color) if (row, col) == odd else (shape, color)
        _draw_shape(draw, this_shape, box, COLORS[this_color])
    return image


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int],
                fill: tuple[int, int, int]) -> None:
    left, top, right, bottom = box
    middle_x, middle_y = (left + right) // 2, (top + bottom) // 2
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(middle_x, top), (right, bottom), (left, bottom)], fill=fill)
    else:  # diamond (reset accepts only SHAPES)
        draw.polygon([(middle_x, top), (right, middle_y), (middle_x, bottom), (left, middle_y)], fill=fill)


def split_of_task(task_id: str) -> str:
    """About 70% train, 10% validation, 20% test, from the hash of the id (the way bfcl's splits are drawn)."""
    if split_of(task_id) == "test":
        return "test"
    return "validation" if split_of(f"{task_id}-validation", test_fraction=0.125) == "test" else "train"


def grids() -> Iterator[dict[str, Any]]:
    """Every task: each grid size, shape and colour, with an odd cell anywhere differing in shape or in colour."""
    for size, shape, color in itertools.product(GRID_SIZES, SHAPES, COLORS):
        odd_looks = [(other, color) for other in SHAPES if other != shape]
        odd_looks += [(shape, other) for other in COLORS if other != color]
        for (odd_shape, odd_color), row, col in itertools.product(odd_looks, range(1, size + 1),
                                                                  range(1, size + 1)):
            yield {"task_id": f"odd-{size}x{size}-{color}-{shape}-r{row}c{col}-{odd_color}-{odd_shape}",
                   "size": size, "shape": shape, "color": color, "odd_row": row, "odd_col": col,
                   "odd_shape": odd_shape, "odd_color": odd_color}


def tasks(split: str, seed: int) -> Iterator[dict[str, Any]]:
    """Tasks of one split in a seeded order; a task belongs to one split only, whatever the seed."""
    chosen = [task for task in grids() if split_of_task(task["task_id"]) == split]
    random.Random(seed).shuffle(chosen)
    yield from chosen


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: look once, then answer with the odd cell read from the task (the image's source state)."""
    if not any(m["role"] == "tool" for m in messages):
        return tool_call_message("look", {})
    return tool_call_message("answer", {"row": task["odd_row"], "col": task["odd_col"]})


SYSTEM_PROMPT = (
    "You find the odd one out in a grid of shapes. Look at the grid, then answer with the row and column of the one "
    "cell that differs from the others."
)

# Two tool calls solve a task; the other turns are room for a malformed call or a second look. The token budget
# leaves room for images: a real vision model may spend a few hundred tokens on each (Gemma 3: 256).
SPEC = EnvSpec(name="odd_one_out", env_cls=OddOneOut, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               splits=("train", "validation", "test"),
               limits=EpisodeLimits(max_turns=4, max_episode_tokens=2048, max_new_tokens=128))
