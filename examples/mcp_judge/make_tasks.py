"""Writes the example's tasks, ``train.parquet`` (48 rows) and ``test.parquet`` (16 rows), with the Hugging Face
``datasets`` library. Their columns are named as a dataset of your own might name them (``question``, ``expected``)
and the config maps them to the fields an MCP env reads (``prompt``, ``answer``); ``value``, ``from_unit`` and
``to_unit`` stay as they are, for the scripted demonstrator (``policy.py``).

    python examples/mcp_judge/make_tasks.py      (from the repository root; the files are committed)
"""

from __future__ import annotations

import random
from pathlib import Path

from datasets import Dataset

from examples.mcp_judge.server import UNITS, convert_value

HERE = Path(__file__).resolve().parent
SIZES = {"train": 48, "test": 16}


def rows(count: int, seed: int) -> list[dict]:
    """``count`` different conversion questions between two different units of one quantity, drawn by ``seed``;
    an answer is between 0.1 and 100,000 (2 decimals keep its value). Rows are unique: a task's id is a hash of its
    content, and collect refuses an episode id twice."""
    rng = random.Random(seed)
    made: list[dict] = []
    while len(made) < count:
        from_unit = rng.choice(sorted(UNITS))
        to_unit = rng.choice([u for u in sorted(UNITS) if UNITS[u][0] == UNITS[from_unit][0] and u != from_unit])
        value = rng.randint(1, 50)
        if not 0.1 <= float(convert_value(value, from_unit, to_unit)) <= 100_000:
            continue
        if any((row["value"], row["from_unit"], row["to_unit"]) == (value, from_unit, to_unit) for row in made):
            continue
        made.append({"question": f"Convert {value} {from_unit} to {to_unit}. Use the convert tool, then answer with "
                                 "the number only.",
                     "expected": convert_value(value, from_unit, to_unit),
                     "value": value, "from_unit": from_unit, "to_unit": to_unit})
    return made


def main() -> None:
    for seed, (split, count) in enumerate(SIZES.items()):
        Dataset.from_list(rows(count, seed)).to_parquet(HERE / f"{split}.parquet")


if __name__ == "__main__":
    main()
