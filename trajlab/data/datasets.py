"""Trajectories -> Hugging Face datasets: SFT rows, RL task lists and preference pairs.

Representation, and why
-----------------------
Messages, tool schemas and tasks are JSON whose shape varies from row to row: one tool call has arguments
``{"a", "b"}``, the next ``{"answer"}``; tool schemas nest differently per tool. Two obvious encodings change the
data silently, which a training set must never do:

- Arrow structs (what ``Dataset.from_list`` infers) take the union of keys across rows and fill the missing ones
  with None, so ``add(a, b)`` in one row makes ``submit(answer)`` elsewhere come back as
  ``submit(answer, a=None, b=None)``.
- The ``datasets.Json`` feature (measured with datasets 5.2) keeps each row's own keys, but goes through pandas'
  ujson: it writes floats rounded to 10 decimal places, reads them with an imprecise parser (``"0.3"`` comes back
  as ``0.30000000000000004``) and cannot read integers past 64 bits. A float tool argument then renders as
  different text, hence different tokens.

So every such value is stored as **JSON text written by Python's json module** (exact for every JSON value, floats
included) in a plain string column: ``messages``, ``tools`` and ``task``. A string is stored the same way by
``save_to_disk``, Parquet and JSON Lines, and any reader (pandas, DuckDB, jq) sees exactly what was written.
Decode with ``json.loads(row["messages"])``, or iterate ``decoded_rows(ds)``, which decodes every JSON column.

What TRL consumes is in the shape TRL expects:

- SFT: ``input_ids`` (prompt + completion tokens, exactly as rolled out) and ``assistant_masks`` (0 on the prompt
  and on every observation token, the trajectory's loss mask elsewhere). TRL's ``SFTTrainer`` treats a dataset with
  ``input_ids`` as pre-tokenized and builds ``labels`` from ``assistant_masks`` (-100 where the mask is 0), so SFT
  trains on the exact tokens of the rollout whatever the chat template. ``messages`` and ``tools`` ride along for
  reading; TRL never re-renders them.
- SFT with images: ``images`` holds each row's images in the order of their placeholder tokens in ``input_ids``,
  as ``List(Image())`` with the PNG bytes embedded (and the image id as the path), so a saved dataset needs no image
  folder. Rows without images hold ``[]``; a dataset of text-only trajectories has no ``images`` column at all.
- Preference (DPO): TRL only accepts ``prompt``/``chosen``/``rejected`` as lists of message dicts, so these three
  are ``List(Json())`` columns, each message written as exact JSON text. Reading them through ``datasets``
  (``ds[i]``, and TRL, which re-renders the conversation with the chat template) still uses the ujson decoder;
  ``preference_dataset`` warns when a pair holds a number that decoder would change. ``decoded_rows`` reads them
  exactly. ``tools`` stays JSON text: TRL ``json.loads`` a string ``tools`` column itself.

``save_dataset`` / ``load_saved_dataset`` keep these types in all three formats (JSON Lines holds the decoded
values and is re-encoded by column name on load), except that JSON Lines refuses ``images``: it would hold each PNG
as base64 text, which the trajectory store avoids on purpose.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.features.features import get_nested_type
from datasets.table import InMemoryTable

from trajlab.data.filters import shortest_success_per_task, successes, within_tokens
from trajlab.rollout.samples import expand
from trajlab.rollout.types import Trajectory, task_id, task_key

logger = logging.getLogger(__name__)

Format = Literal["disk", "jsonl", "parquet"]

JSON_TEXT_COLUMNS: frozenset[str] = frozenset({"messages", "tools", "task"})
"""Columns holding one JSON document as text; ``json.loads`` gives back the original value exactly."""

CONVERSATION_COLUMNS: frozenset[str] = frozenset({"prompt", "chosen", "rejected"})
"""Columns holding a list of messages as ``List(Json())``, the shape TRL's conversational formats require."""

_STRING = datasets.Value("string")
_FLOAT = datasets.Value("float64")
COLUMN_FEATURES: dict[str, Any] = {
    "id": _STRING,
    "env": _STRING,
    "task_id": _STRING,
    "split": _STRING,
    "reward": _FLOAT,
    "success": datasets.Value("bool"),
    "input_ids": datasets.List(datasets.Value("int32")),
    "assistant_masks": datasets.List(datasets.Value("int8")),
    "chosen_id": _STRING,
    "rejected_id": _STRING,
    "chosen_reward": _FLOAT,
    "rejected_reward": _FLOAT,
    "images": datasets.List(datasets.Image()),
}
"""Types of the scalar, token and image columns trajlab writes; any other column is left to Arrow's inference."""

PREFERENCE_COLUMNS: tuple[str, ...] = (
    "prompt", "chosen", "rejected", "tools", "task_id", "env", "chosen_reward", "rejected_reward", "chosen_id",
    "rejected_id",
)
RL_COLUMNS: tuple[str, ...] = ("env", "task_id", "task", "split")


# --- builders ---------------------------------------------------------------------------------------------------


def sft_dataset(
    ts: Iterable[Trajectory],
    *,
    include_failures: bool,
    shortest_per_task: bool,
    max_tokens: int | None = None,
) -> datasets.Dataset:
    """Demonstrations for supervised fine-tuning, one row per trajectory, in input order.

    Columns: ``id, env, task_id, reward, messages, tools`` (``success`` too with ``include_failures``), and, when
    every selected trajectory has a token record, ``input_ids`` and ``assistant_masks`` for TRL's SFTTrainer. A
    text-only trajectory among them drops both columns (with a warning): SFT on text re-renders the chat template
    and is no longer token-exact. When any selected trajectory saw images, ``images`` too (see the module
    docstring).

    Args:
        ts: trajectories, e.g. ``read_trajectories(path)``.
        include_failures: keep failed and truncated episodes too (as negatives, told apart by ``success``).
            Episodes with status ``error`` are never kept. TRL's SFTTrainer would imitate failures like any
            other row: filter on ``success`` or weight rows by it before plain SFT.
        shortest_per_task: of each task's successes keep only the shortest (``shortest_success_per_task``), so
            the model imitates the most direct solution; failures are unaffected.
        max_tokens: drop trajectories longer than this many tokens (applied first, so the shortest success that
            fits is kept). Text-only trajectories cannot be measured and are kept (see ``within_tokens``).
    """
    ts = list(ts)
    chosen = [t for t in ts if t.status != "error"] if include_failures else successes(ts)
    if max_tokens is not None:
        chosen = within_tokens(chosen, max_tokens)
    if shortest_per_task:
        best = {id(t) for t in shortest_success_per_task(chosen)}
        chosen = [t for t in chosen if t.status != "success" or id(t) in best]
    chosen = expand(chosen)  # an episode kept one sample per turn trains as those samples
    tokenized = all(t.tokens is not None for t in chosen)
    if not tokenized:
        logger.warning(
            "%d of %d SFT trajectories have no token record: the dataset has no input_ids/assistant_masks, and "
            "training on it re-renders messages with a chat template (use conversational() to hand it to TRL).",
            sum(t.tokens is None for t in chosen), len(chosen),
        )
    columns = ["id", "env", "task_id", "reward"]
    columns += ["success"] if include_failures else []
    columns += ["messages", "tools"]
    columns += ["input_ids", "assistant_masks"] if tokenized else []
    columns += ["images"] if any(t.images for t in chosen) else []
    return _to_dataset([_sft_row(t) for t in chosen], columns)


def _sft_row(t: Trajectory) -> dict[str, Any]:
    row = {
        "id": t.id, "env": t.env, "task_id": task_id(t.task), "reward": t.reward, "success": t.status == "success",
        "messages": t.messages, "tools": t.tools,
        "images": [{"bytes": t.image_png(image), "path": image} for image in t.images],
    }
    if t.tokens is not None:
        row["input_ids"] = t.tokens.prompt_ids + t.tokens.completion_ids
        row["assistant_masks"] = [0] * len(t.tokens.prompt_ids) + t.tokens.loss_mask
    return row


def rl_dataset(
    ts_or_tasks: Iterable[Trajectory | dict[str, Any]], *, env: str | None = None, split: str | None = None
) -> datasets.Dataset:
    """The tasks to roll out in RL: one row per distinct task (``(env, task_id)``), first occurrence first.

    Columns: ``env, task_id, task, split``; ``task`` is the JSON text of the row passed to ``env.reset(**task)``.
    Trajectories give their own env and split; plain task rows (a tasks file) take ``env`` and ``split`` from the
    keyword arguments.

    Raises:
        ValueError: a plain task row was given without ``env``.
    """
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    for item in ts_or_tasks:
        if isinstance(item, Trajectory):
            row = {"env": item.env, "task_id": task_id(item.task), "task": item.task, "split": item.split}
        elif env is None:
            raise ValueError("rl_dataset got a plain task row: pass env=NAME (and split=) to say where it runs.")
        else:
            row = {"env": env, "task_id": task_id(item), "task": dict(item), "split": split}
        key = (row["env"], row["task_id"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return _to_dataset(rows, RL_COLUMNS)


def preference_dataset(ts: Iterable[Trajectory]) -> datasets.Dataset:
    """Pairs (a success, a failure) of the same task, in TRL's conversational DPO format.

    ``prompt`` is the conversation up to (not including) the first assistant turn; ``chosen`` and ``rejected`` are
    the rest of each episode, tool results included. Two episodes are paired only when they share the task, the
    prompt and the tools, so the pair differs only in what the policy did. Within a task every success and every
    failure appears in at least one pair and no pair repeats (``max(#successes, #failures)`` pairs, cycling
    through the shorter list); two successes are never paired, and ``error`` episodes and episodes without an
    assistant turn are skipped.

    Columns: ``prompt, chosen, rejected, tools, task_id, env, chosen_reward, rejected_reward, chosen_id,
    rejected_id``. Note that TRL's DPOTrainer trains on every completion token, tool results included.
    """
    groups: dict[tuple[str, str, str, str], tuple[list[Trajectory], list[Trajectory]]] = {}
    for t in ts:
        cut = _first_assistant(t.messages)
        if t.status == "error" or cut is None:
            continue
        key = (*task_key(t.env, t.task), _dumps(t.messages[:cut]), _dumps(t.tools))
        wins, losses = groups.setdefault(key, ([], []))
        (wins if t.status == "success" else losses).append(t)
    rows = []
    for wins, losses in groups.values():
        if wins and losses:
            for i in range(max(len(wins), len(losses))):
                rows.append(_pair(wins[i % len(wins)], losses[i % len(losses)]))
    _warn_if_json_feature_inexact(rows)
    return _to_dataset(rows, PREFERENCE_COLUMNS)


def _first_assistant(messages: list[dict[str, Any]]) -> int | None:
    return next((i for i, message in enumerate(messages) if message.get("role") == "assistant"), None)


def _pair(win: Trajectory, loss: Trajectory) -> dict[str, Any]:
    cut = _first_assistant(win.messages)
    return {
        "prompt": win.messages[:cut], "chosen": win.messages[cut:], "rejected": loss.messages[cut:],
        "tools": win.tools, "task_id": task_id(win.task), "env": win.env,
        "chosen_reward": win.reward, "rejected_reward": loss.reward, "chosen_id": win.id, "rejected_id": loss.id,
    }


def _warn_if_json_feature_inexact(rows: list[dict[str, Any]]) -> None:
    changed = sum(any(_json_feature_changes(m) for name in CONVERSATION_COLUMNS for m in row[name]) for row in rows)
    if changed:
        logger.warning(
            "%d of %d preference pairs hold numbers that datasets' Json feature decodes inexactly (0.3 -> "
            "0.30000000000000004) or not at all (integers past 64 bits): TRL re-renders these conversations from "
            "the decoded values, so their text differs from the rollout's. decoded_rows() reads them exactly.",
            changed, len(rows),
        )


def _json_feature_changes(value: Any) -> bool:
    try:
        return datasets.Json().decode_example(_dumps(value)) != value
    except ValueError:
        return True


def conversational(ds: datasets.Dataset, columns: Sequence[str] = ("messages",)) -> datasets.Dataset:
    """A copy with JSON-text conversation columns turned into lists of message dicts (``List(Json())``).

    For handing a text-only SFT dataset to TRL, which then renders ``messages`` with a chat template itself. That
    is not token-exact, and the ``Json`` feature's decoder may change floats (see the module docstring): prefer
    datasets with ``input_ids``.
    """
    return _to_dataset(list(decoded_rows(ds)), ds.column_names, CONVERSATION_COLUMNS | set(columns))


# --- encoding and decoding ---------------------------------------------------------------------------------------


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _to_dataset(
    rows: list[dict[str, Any]], columns: Sequence[str], conversations: frozenset[str] | set[str] = CONVERSATION_COLUMNS
) -> datasets.Dataset:
    """Build the Arrow table column by column from decoded Python values, so no value passes through inference."""
    table = pa.table({name: _column([row[name] for row in rows], name, name in conversations) for name in columns})
    features = datasets.Features.from_arrow_schema(table.schema)
    # Arrow's type of an image column is a plain struct: its feature must be named to decode as images.
    features.update({name: COLUMN_FEATURES[name] for name in columns if name in COLUMN_FEATURES})
    return datasets.Dataset(InMemoryTable(table), info=datasets.DatasetInfo(features=features))


def _column(values: list[Any], name: str, conversation: bool) -> pa.Array:
    if conversation:
        # (rows,) lists of messages -> one ListArray over a flat json-typed array of messages
        offsets = pa.array(list(accumulate((len(v) for v in values), initial=0)), pa.int32())
        texts = pa.array([_dumps(message) for value in values for message in value], pa.string())
        return pa.ListArray.from_arrays(offsets, pa.ExtensionArray.from_storage(pa.json_(), texts))
    if name in JSON_TEXT_COLUMNS:
        return pa.array([_dumps(value) for value in values], pa.string())
    feature = COLUMN_FEATURES.get(name)
    return pa.array(values, type=None if feature is None else get_nested_type(feature))


def decoded_rows(ds: datasets.Dataset) -> Iterator[dict[str, Any]]:
    """Rows with every JSON column decoded exactly (``json.loads`` on the stored text, never ujson).

    This is how to read a trajlab dataset back into the values it was built from: ``messages``, ``tools`` and
    ``task`` become lists and dicts again, and ``Json`` columns (``prompt``/``chosen``/``rejected``) are decoded
    from their stored text instead of through ``datasets``' inexact decoder.
    """
    decoders = {name: _decoder(name, feature) for name, feature in ds.features.items()}
    for batch in ds.with_format("arrow").iter(batch_size=256):
        for row in batch.to_pylist():  # Json values come out of Arrow as their raw text
            yield {name: decoders[name](value) for name, value in row.items()}


def _decoder(name: str, feature: Any) -> Any:
    if isinstance(feature, datasets.Json) or (name in JSON_TEXT_COLUMNS and feature == _STRING):
        return _loads
    if isinstance(feature, datasets.List) and isinstance(feature.feature, datasets.Json):
        return lambda value: None if value is None else [_loads(item) for item in value]
    return lambda value: value


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


# --- saving and loading -----------------------------------------------------------------------------------------


def _format_of(path: Path, format: Format | None) -> Format:
    if format is not None:
        if format not in ("disk", "jsonl", "parquet"):
            raise ValueError(f"Unknown dataset format {format!r}: use disk, jsonl or parquet.")
        return format
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix, "disk")


def save_dataset(ds: datasets.Dataset, path: str | Path, format: Format | None = None) -> Path:
    """Write a dataset; ``format`` defaults to the suffix: ``.jsonl``, ``.parquet``, anything else a directory.

    JSON Lines holds each row's decoded values (``messages`` as a list, not a string), written by Python's json
    module so every float is exact. The file is written beside the target and renamed into place, so a crash never
    leaves a half-written file under the final name.

    Returns:
        The path written.

    Raises:
        ValueError: JSON Lines for a dataset with images (use Parquet or a directory).
    """
    path = Path(path)
    fmt = _format_of(path, format)
    if fmt == "jsonl" and "images" in ds.column_names:
        raise ValueError(f"{path}: JSON Lines cannot hold the dataset's images (each PNG would become base64 text); "
                         "save it as FILE.parquet or a directory.")
    if fmt == "disk":
        ds.save_to_disk(str(path))
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if fmt == "parquet":
        ds.to_parquet(str(partial))  # the features, Json included, travel in the Parquet schema metadata
    else:
        with open(partial, "w", encoding="utf-8") as handle:
            for row in decoded_rows(ds):
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(partial, path)
    return path


def load_saved_dataset(path: str | Path, format: Format | None = None) -> datasets.Dataset:
    """Read a dataset written by ``save_dataset``, with the same column types (the inverse of ``save_dataset``).

    JSON Lines is parsed with Python's json module and re-encoded by column name (``messages``/``tools``/``task`` as
    JSON text, ``prompt``/``chosen``/``rejected`` as ``List(Json())``); columns trajlab does not know are typed by
    Arrow's inference. An empty JSON Lines file gives an empty dataset without columns.
    """
    path = Path(path)
    fmt = _format_of(path, format)
    if fmt == "disk":
        loaded = datasets.load_from_disk(str(path))
        if not isinstance(loaded, datasets.Dataset):
            raise ValueError(f"{path} holds a {type(loaded).__name__}, not a single dataset")
        return loaded
    if fmt == "parquet":
        return datasets.Dataset(InMemoryTable(pq.read_table(path)))
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return _to_dataset(rows, list(rows[0]) if rows else [])
