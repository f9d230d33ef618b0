"""Filters and dataset builders, on hand-made trajectories and on real rollouts of the reference policy.

The round-trip tests use data made to break naive encodings: tool calls whose arguments have different keys from
row to row, tool schemas of different shapes, floats that ujson reads back wrong (0.3), integers past 64 bits.
"""

import asyncio
import itertools
import json
import math

import datasets
import pytest
import torch
from PIL import Image
from trl import SFTConfig, SFTTrainer
from trl.data_utils import is_conversational

from trajlab.chat.parsers import get_parser
from trajlab.data.datasets import (
    conversational,
    decoded_rows,
    load_saved_dataset,
    preference_dataset,
    rl_dataset,
    save_dataset,
    sft_dataset,
)
from trajlab.data.filters import (
    failures,
    shortest_success_per_task,
    successes,
    within_tokens,
)
from trajlab.env import load_env
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.models.loading import load_model
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.images import encode_png
from trajlab.rollout.runner import Episode
from trajlab.rollout.types import TokenRecord, Trajectory, task_id

# --- hand-made trajectories --------------------------------------------------------------------------------------

TOOLS_A = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
TOOLS_B = [
    {"type": "function", "function": {"name": "scale", "parameters": {"type": "object", "properties": {
        "factor": {"type": "number", "minimum": 0.3}, "mode": {"type": "string", "enum": ["fast", "exact"]},
        "tags": {"type": "array", "items": {"type": "string"}}}}}},
    {"type": "function", "function": {"name": "reset", "description": "No parameters at all."}},
]


def call(name: str, arguments: dict, content: str | None = "") -> dict:
    message = {"role": "assistant", "tool_calls": [{"id": f"call-{name}", "type": "function",
                                                    "function": {"name": name, "arguments": arguments}}]}
    if content is not None:  # None: no "content" key at all
        message["content"] = content
    return message


def make(i, *, task=None, status="success", env="toy", arguments=None, tools=TOOLS_A, n_tokens=4, tokens=True,
         turns=1, reward=None, prompt="Compute."):
    """A trajectory of ``turns`` tool calls; its token record holds ``n_tokens`` tokens in all."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    for turn in range(turns):
        messages.append(call("add", arguments if arguments is not None else {"a": i, "b": turn}))
        messages.append({"role": "tool", "tool_call_id": "call-add", "name": "add", "content": str(i + turn)})
    record = None
    if tokens:
        completion = list(range(100, 100 + n_tokens - 2))
        record = TokenRecord(prompt_ids=[1, 2], completion_ids=completion,
                             loss_mask=[1 if k % 3 else 0 for k in range(len(completion))],
                             logprobs=[None] * len(completion))
    return Trajectory(id=f"ep{i}", env=env, task=task if task is not None else {"task_id": f"t{i}"},
                      messages=messages, tools=tools, reward=(1.0 if status == "success" else 0.0) if reward is None
                      else reward, status=status, tokens=record)


def tricky() -> list[Trajectory]:
    """Rows whose JSON differs in shape, with values naive encodings change."""
    return [
        make(0, arguments={"a": 2**70, "b": -1}, task={"task_id": "big", "limit": 2**70, "nested": {"x": [1, 2]}}),
        make(1, arguments={"factor": 0.3, "mode": "exact"}, status="failure", reward=1 / 3,
             task={"task_id": "big", "limit": 2**70, "nested": {"x": [1, 2]}}),
        make(2, arguments={"tags": ["é", "😀", "\u2028"], "ratio": 1e-7}, tools=TOOLS_B,
             task={"target": 0.1 + 0.2, "text": "naïve ✓"}),
        make(3, arguments={}, tools=[], task={"task_id": 7}, status="truncated"),
    ] + [Trajectory(id="ep4", env="other", task={"task_id": "big"}, tools=TOOLS_A, reward=0.7, status="failure",
                    messages=[{"role": "user", "content": None}, call("add", {"b": 0.7}, content=None)],
                    tokens=TokenRecord(prompt_ids=[5], completion_ids=[6, 7], loss_mask=[1, 0], logprobs=[-0.1, None]))]


# --- real trajectories -------------------------------------------------------------------------------------------


def rollout(env_name, tokenizer, template, n_tasks, policy=None):
    spec = load_env(env_name)
    tasks = list(itertools.islice(spec.iter_tasks("train", seed=0), n_tasks))
    generator = ScriptedGenerator(policy or spec.oracle, tokenizer, template)
    engine = RolloutEngine(spec, generator, tokenizer, chat_template=template, parser=get_parser("auto", tokenizer),
                           seed=0)
    episodes = [Episode(f"{t['task_id']}:{policy is not None}", t, split="train") for t in tasks]
    return sorted(asyncio.run(engine.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0)), key=lambda t: t.id)


def off_by_one(task, messages):
    """The reference policy, except that it submits a wrong answer: a real failure of the same task."""
    message = load_env("arithmetic").oracle(task, messages)
    function = message["tool_calls"][0]["function"]
    if function["name"] == "submit":
        function["arguments"] = {"answer": function["arguments"]["answer"] + 1}
    return message


@pytest.fixture(scope="module")
def real(tiny_tokenizer, tiny_template):
    """5 arithmetic tasks solved and failed, and 3 guess tasks solved: 13 trajectories, two tool sets."""
    solved = rollout("arithmetic", tiny_tokenizer, tiny_template, 5)
    failed = rollout("arithmetic", tiny_tokenizer, tiny_template, 5, policy=off_by_one)
    guessed = rollout("guess", tiny_tokenizer, tiny_template, 3)
    assert [t.status for t in solved + guessed] == ["success"] * 8
    assert [t.status for t in failed] == ["failure"] * 5
    return solved + failed + guessed


def render(tokenizer, template, messages, tools):
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)


# --- filters -----------------------------------------------------------------------------------------------------


def test_a_task_is_its_env_and_task_id_in_every_grouping():
    """Two envs may both have a task ``abc`` (or the same row without an id): two tasks for every filter and dataset."""
    one, same = {"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"d": 3, "c": 2}, "a": 1}
    for task in ({"task_id": "abc", "x": 1}, one):
        ts = [make(0, task=task), make(1, task=task, n_tokens=3), make(2, task=task, env="other")]
        assert [t.id for t in shortest_success_per_task(ts)] == ["ep1", "ep2"]
        rl = rl_dataset(ts)
        assert list(zip(rl["env"], rl["task_id"], strict=True)) == [("toy", task_id(task)), ("other", task_id(task))]
        assert sft_dataset(ts, include_failures=False, shortest_per_task=False)["task_id"] == [task_id(task)] * 3
    assert sft_dataset([make(0, task={"task_id": "abc", "x": 1})], include_failures=False,
                       shortest_per_task=False)["task_id"] == ["abc"]
    # key order does not make another task; the id written is the one evaluation reports use
    assert rl_dataset([make(0, task=one), make(1, task=same)])["task_id"] == ["task-f85d0f485672"]


def test_successes_and_failures_leave_errors_out():
    ts = [make(i, status=s) for i, s in enumerate(["success", "failure", "truncated", "error", "success"])]
    assert [t.id for t in successes(ts)] == ["ep0", "ep4"]
    assert [t.id for t in failures(ts)] == ["ep1", "ep2"]


def test_shortest_success_per_task_picks_the_fewest_tokens_else_turns():
    ts = [
        make(0, task={"task_id": "A"}, n_tokens=10),
        make(1, task={"task_id": "B"}, tokens=False, turns=3),
        make(2, task={"task_id": "A"}, n_tokens=6),
        make(3, task={"task_id": "A"}, n_tokens=3, status="failure"),  # shorter, but not a success
        make(4, task={"task_id": "A"}, n_tokens=6),  # ties with ep2, comes later
        make(5, task={"task_id": "B"}, tokens=False, turns=2),
        make(6, task={"task_id": "B"}, n_tokens=3, turns=4),  # B mixes text and tokens: compare turns
        make(7, task={"task_id": "C"}, n_tokens=8),
    ]
    assert [t.id for t in shortest_success_per_task(ts)] == ["ep2", "ep5", "ep7"]


def test_within_tokens_bounds_tokenized_and_keeps_text_only():
    ts = [make(0, n_tokens=5), make(1, n_tokens=10), make(2, n_tokens=11), make(3, tokens=False, turns=9)]
    assert [t.id for t in within_tokens(ts, 10)] == ["ep0", "ep1", "ep3"]
    assert [t.id for t in within_tokens(ts, 4)] == ["ep3"]


# --- SFT ---------------------------------------------------------------------------------------------------------


def test_sft_rows_are_the_exact_trajectory_tokens(real, tiny_tokenizer, tiny_template):
    ds = sft_dataset(real, include_failures=False, shortest_per_task=False)
    assert ds.column_names == ["id", "env", "task_id", "reward", "messages", "tools", "input_ids", "assistant_masks"]
    wins = successes(real)
    assert ds["id"] == [t.id for t in wins]
    for row, t in zip(decoded_rows(ds), wins, strict=True):
        assert row["input_ids"] == t.tokens.prompt_ids + t.tokens.completion_ids
        assert row["assistant_masks"] == [0] * len(t.tokens.prompt_ids) + t.tokens.loss_mask
        assert 0 < sum(row["assistant_masks"]) < len(row["input_ids"])  # model tokens trained, the rest not
        assert (row["messages"], row["tools"], row["task_id"]) == (t.messages, t.tools, t.task["task_id"])
        # the tokens are the conversation as the chat template renders it
        assert tiny_tokenizer.decode(row["input_ids"]) == render(tiny_tokenizer, tiny_template, t.messages, t.tools)


def test_sft_selection_options():
    ts = [
        make(0, task={"task_id": "A"}, n_tokens=9),
        make(1, task={"task_id": "A"}, n_tokens=5),
        make(2, task={"task_id": "A"}, n_tokens=4, status="failure"),
        make(3, task={"task_id": "B"}, n_tokens=30),
        make(4, task={"task_id": "B"}, status="error"),
        make(5, task={"task_id": "C"}, n_tokens=7, status="truncated"),
    ]
    assert sft_dataset(ts, include_failures=False, shortest_per_task=False)["id"] == ["ep0", "ep1", "ep3"]
    assert "success" not in sft_dataset(ts, include_failures=False, shortest_per_task=False).column_names
    with_failures = sft_dataset(ts, include_failures=True, shortest_per_task=False)
    assert with_failures["id"] == ["ep0", "ep1", "ep2", "ep3", "ep5"]  # never the error
    assert with_failures["success"] == [True, True, False, True, False]
    assert sft_dataset(ts, shortest_per_task=True, include_failures=False)["id"] == ["ep1", "ep3"]
    assert sft_dataset(ts, include_failures=True, shortest_per_task=True)["id"] == ["ep1", "ep2", "ep3", "ep5"]
    assert sft_dataset(ts, max_tokens=8, include_failures=False, shortest_per_task=False)["id"] == ["ep1"]
    assert sft_dataset(ts, max_tokens=29, shortest_per_task=True, include_failures=False)["id"] == ["ep1"]
    assert all(len(ids) <= 8 for ids in sft_dataset(ts, include_failures=True, max_tokens=8,
                                                    shortest_per_task=False)["input_ids"])


def test_sft_without_token_records_has_no_token_columns_and_converts_for_trl(caplog):
    ds = sft_dataset([make(0), make(1, tokens=False)], include_failures=False, shortest_per_task=False)
    assert "input_ids" not in ds.column_names and "assistant_masks" not in ds.column_names
    assert "no token record" in caplog.text
    assert isinstance(ds[0]["messages"], str) and not is_conversational(ds[0])
    trl_ready = conversational(ds)
    assert is_conversational(trl_ready[0])
    assert trl_ready[1]["messages"] == make(1).messages and json.loads(trl_ready[1]["tools"]) == TOOLS_A


# --- RL ----------------------------------------------------------------------------------------------------------


def test_rl_dataset_has_one_row_per_task(real):
    ds = rl_dataset(real)
    assert ds.column_names == ["env", "task_id", "task", "split"]
    tasks = {(t.env, task_id(t.task)): t.task for t in real}
    assert len(ds) == len(tasks) == 8  # 5 arithmetic tasks (solved and failed), 3 guess tasks
    for row in decoded_rows(ds):
        assert row["task"] == tasks[row["env"], row["task_id"]] and row["split"] == "train"
    plain = rl_dataset([t.task for t in real], env="arithmetic", split="test")
    assert len(plain) == 8 and set(plain["split"]) == {"test"}
    with pytest.raises(ValueError, match="env="):
        rl_dataset([{"task_id": "x"}])


# --- preference --------------------------------------------------------------------------------------------------


def test_preference_pairs_a_success_and_a_failure_of_the_same_task(real, tiny_tokenizer, tiny_template):
    by_id = {t.id: t for t in real}
    ds = preference_dataset(real)
    assert len(ds) == 5  # one per arithmetic task; guess tasks have no failure
    for row in decoded_rows(ds):
        win, loss = by_id[row["chosen_id"]], by_id[row["rejected_id"]]
        assert (win.env, task_id(win.task)) == (loss.env, task_id(loss.task)) == (row["env"], row["task_id"])
        assert (win.status, loss.status) == ("success", "failure")
        assert (row["chosen_reward"], row["rejected_reward"]) == (win.reward, loss.reward) == (1.0, 0.0)
        assert all(m["role"] != "assistant" for m in row["prompt"]) and row["chosen"][0]["role"] == "assistant"
        assert row["prompt"] + row["chosen"] == win.messages and row["prompt"] + row["rejected"] == loss.messages
        # what TRL's DPO renders for prompt + chosen is exactly the chosen rollout's tokens
        assert render(tiny_tokenizer, tiny_template, row["prompt"] + row["chosen"], row["tools"]) == \
            tiny_tokenizer.decode(win.tokens.prompt_ids + win.tokens.completion_ids)
    assert is_conversational(ds[0]) and isinstance(ds[0]["prompt"], list)


def test_preference_pairing_rules():
    ts = [
        make(0, task={"task_id": "A"}),
        make(1, task={"task_id": "A"}),  # two successes and nothing else: never paired together
        make(2, task={"task_id": "B"}),
        make(3, task={"task_id": "B"}, status="failure"),
        make(4, task={"task_id": "B"}, status="truncated"),
        make(5, task={"task_id": "B"}, status="failure"),
        make(6, task={"task_id": "B"}, status="error"),
        make(7, task={"task_id": "C"}, status="failure"),  # no success
        make(8, task={"task_id": "B"}, status="failure", prompt="Another prompt."),  # same task, other prompt
        make(9, task={"task_id": "B"}, status="failure", env="other"),  # same task id, other env
    ]
    ds = preference_dataset(ts)
    assert list(zip(ds["chosen_id"], ds["rejected_id"], strict=True)) == [("ep2", "ep3"), ("ep2", "ep4"),
                                                                          ("ep2", "ep5")]
    more = preference_dataset([make(0, task={"task_id": "A"}), make(1, task={"task_id": "A"}),
                               make(2, task={"task_id": "A"}), make(3, task={"task_id": "A"}, status="failure")])
    assert list(zip(more["chosen_id"], more["rejected_id"], strict=True)) == [("ep0", "ep3"), ("ep1", "ep3"),
                                                                              ("ep2", "ep3")]
    assert len(preference_dataset([])) == 0 and preference_dataset([]).column_names[:3] == ["prompt", "chosen",
                                                                                            "rejected"]


# --- exact round trip --------------------------------------------------------------------------------------------


def test_naive_encodings_change_the_data():
    """Why the module stores JSON text: both obvious encodings alter values (revisit if this starts failing)."""
    structs = datasets.Dataset.from_list([{"args": {"a": 1}}, {"args": {"b": 2}}])
    assert structs[0]["args"] == {"a": 1, "b": None}
    assert datasets.Json().decode_example(json.dumps({"x": 0.3})) != {"x": 0.3}


@pytest.mark.parametrize("name", ["ds", "ds.jsonl", "ds.parquet"])
def test_exact_round_trip_in_every_format(name, tmp_path, real):
    ts = tricky() + real
    built = {
        "sft": sft_dataset(ts, include_failures=True, shortest_per_task=False),
        "rl": rl_dataset(ts),
        "preference": preference_dataset(ts),
    }
    assert len(built["preference"]) == 6  # 5 real pairs, and ep0 with ep1 (whose rejected turn holds 0.3)
    for kind, ds in built.items():
        path = save_dataset(ds, tmp_path / kind / name)
        assert path.is_dir() == (name == "ds")
        loaded = load_saved_dataset(path)
        assert loaded.features == ds.features and len(loaded) == len(ds)
        assert list(decoded_rows(loaded)) == list(decoded_rows(ds))

    by_id = {t.id: t for t in ts}
    sft = load_saved_dataset(save_dataset(built["sft"], tmp_path / "again" / name))
    for row in decoded_rows(sft):
        t = by_id[row["id"]]
        assert (row["messages"], row["tools"], row["reward"]) == (t.messages, t.tools, t.reward)
    first, second = (json.loads(text) for text in sft["messages"][:2])
    assert first[2]["tool_calls"][0]["function"]["arguments"] == {"a": 2**70, "b": -1}  # no keys gained
    assert second[2]["tool_calls"][0]["function"]["arguments"] == {"factor": 0.3, "mode": "exact"}
    rl = {row["task_id"]: row for row in decoded_rows(load_saved_dataset(save_dataset(built["rl"], tmp_path / name)))}
    assert rl[task_id(by_id["ep2"].task)]["task"] == {"target": 0.1 + 0.2, "text": "naïve ✓"}


def test_sft_images_travel_inside_the_dataset_in_placeholder_order(tmp_path):
    pngs = dict(encode_png(Image.new("RGB", (8, 8), color)) for color in ((255, 0, 0), (0, 0, 255)))
    red, blue = pngs
    seen = Trajectory.model_validate(make(0).model_dump() | {"images": [blue, red, blue]})
    seen.attach_images(pngs)
    ds = sft_dataset([seen, make(1)], include_failures=False, shortest_per_task=False)
    assert ds.features["images"] == datasets.List(datasets.Image())
    assert [image.getpixel((0, 0)) for image in ds[0]["images"]] == [(0, 0, 255), (255, 0, 0), (0, 0, 255)]
    rows = list(decoded_rows(ds))
    assert rows[0]["images"] == [{"bytes": pngs[i], "path": i} for i in (blue, red, blue)] and rows[1]["images"] == []
    for name in ("ds", "ds.parquet"):  # self-contained: the PNG bytes are in the files
        loaded = load_saved_dataset(save_dataset(ds, tmp_path / name))
        assert loaded.features == ds.features and list(decoded_rows(loaded)) == rows
    with pytest.raises(ValueError, match="JSON Lines cannot hold the dataset's images"):
        save_dataset(ds, tmp_path / "ds.jsonl")
    assert not (tmp_path / "ds.jsonl").exists()
    assert "images" not in sft_dataset([make(1), make(2)], include_failures=False,
                                       shortest_per_task=False).column_names, "text-only datasets are as before"


# --- TRL ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow(7)
def test_trl_sft_trainer_trains_on_assistant_masks(real, tiny_model_dir, tiny_tokenizer, tmp_path):
    ds = load_saved_dataset(save_dataset(sft_dataset(real, include_failures=False, shortest_per_task=False),
                                         tmp_path / "sft.parquet"))
    masks = {tuple(row["input_ids"]): row["assistant_masks"] for row in ds}
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, report_to="none",
                     use_cpu=True, max_length=None, save_strategy="no", logging_steps=1, learning_rate=1e-3)
    trainer = SFTTrainer(model=load_model(tiny_model_dir), args=args, train_dataset=ds,
                         processing_class=tiny_tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["labels"].shape == batch["input_ids"].shape
    for ids, labels, attention in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
        n = int(attention.sum())
        mask = torch.tensor(masks[tuple(ids[:n].tolist())])
        assert torch.equal(labels[:n] == -100, mask == 0)
        assert torch.equal(labels[:n][mask == 1], ids[:n][mask == 1])
        assert bool((labels[n:] == -100).all())
    result = trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(result.training_loss)
