import itertools
import json
import sys
from collections import defaultdict

import pytest
from PIL import Image

from tests.env.oracle import run_oracle
from trajlab.env import load_env
from trajlab.env.base import tool_schemas
from trajlab.env.builtin.odd_one_out import IMAGE_PX, SPEC, OddOneOut, grids, oracle, render
from trajlab.errors import MissingDependency
from trajlab.inference.policy import load_policy

ALL = list(grids())


def started(task: dict) -> tuple[OddOneOut, str]:
    env = OddOneOut()
    return env, env.reset(**task)


def cells(image: Image.Image, size: int) -> dict[tuple[int, int], bytes]:
    """Each cell's pixels by (row, col), counted from 1 as the tools do."""
    cell, margin = IMAGE_PX // size, (IMAGE_PX - IMAGE_PX // size * size) // 2
    return {(row, col): image.crop((margin + (col - 1) * cell, margin + (row - 1) * cell,
                                    margin + col * cell, margin + row * cell)).tobytes()
            for row, col in itertools.product(range(1, size + 1), repeat=2)}


def play(policy, task: dict) -> OddOneOut:
    """Run a policy straight on the env, feeding it the conversation as the engine builds it."""
    env, observation = started(task)
    messages = [{"role": "user", "content": observation}]
    while not env.done:
        message = policy(task, messages)
        call = message["tool_calls"][0]["function"]
        messages += [message, {"role": "tool", "content": getattr(env, call["name"])(**call["arguments"])}]
    return env


def test_tools_have_schemas_and_tasks_are_json():
    schemas = {t["function"]["name"]: t["function"] for t in tool_schemas(OddOneOut)}
    assert set(schemas) == {"look", "answer"}
    assert schemas["look"]["parameters"]["properties"] == {}
    assert set(schemas["answer"]["parameters"]["required"]) == {"row", "col"}
    task = next(SPEC.iter_tasks("train", seed=0))
    assert json.loads(json.dumps(task)) == task


def test_look_shows_the_odd_cell_and_only_there_do_the_pixels_differ():
    for task in ALL:
        env, _ = started(task)
        image = env.look()
        assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (IMAGE_PX, IMAGE_PX)
        by_cell = cells(image, task["size"])
        odd = by_cell.pop((task["odd_row"], task["odd_col"]))
        assert len(set(by_cell.values())) == 1, task["task_id"]  # every other cell looks the same
        assert odd != next(iter(by_cell.values())), task["task_id"]
    assert env.metrics["looks"] == 1


@pytest.mark.parametrize("size", [2, 8])
def test_a_tasks_file_may_hold_other_grid_sizes(size):
    task = {**ALL[0], "size": size, "odd_row": size, "odd_col": 1}
    by_cell = cells(started(task)[0].look(), size)
    odd = by_cell.pop((size, 1))
    assert len(set(by_cell.values())) == 1 and odd not in by_cell.values()


def test_rendering_is_deterministic():
    task = ALL[0]
    first, again = started(task)[0].look(), started(task)[0].look()
    assert first.tobytes() == again.tobytes()
    args = (task["size"], task["shape"], task["color"], (task["odd_row"], task["odd_col"]), task["odd_shape"],
            task["odd_color"])
    assert render(*args).tobytes() == first.tobytes()


def test_splits_are_disjoint_seeded_and_cover_every_task():
    splits = {split: [t["task_id"] for t in SPEC.iter_tasks(split, seed=0)] for split in SPEC.splits}
    assert SPEC.splits == ("train", "validation", "test")
    ids = [task_id for split in splits.values() for task_id in split]
    assert len(ids) == len(set(ids)) == len(ALL)
    shares = {split: len(found) / len(ALL) for split, found in splits.items()}
    assert shares["train"] == pytest.approx(0.7, abs=0.05) and shares["validation"] == pytest.approx(0.1, abs=0.03)
    assert sorted(t["task_id"] for t in SPEC.iter_tasks("test", seed=3)) == sorted(splits["test"])
    assert [t["task_id"] for t in itertools.islice(SPEC.iter_tasks("test", seed=3), 20)] != splits["test"][:20]
    assert {t["size"] for t in SPEC.iter_tasks("test", seed=0)} == {3, 4}


def test_no_text_the_model_reads_says_where_the_odd_cell_is():
    """The first observation depends on the grid size only (the system prompt and tool descriptions on nothing);
    look gives an image, and answer says only right or wrong."""
    seen: dict[int, set[str]] = defaultdict(set)
    replies = set()
    for task in ALL:
        env, observation = started(task)
        seen[task["size"]].add(observation)
        assert not isinstance(env.look(), str)
        wrong = (task["odd_row"] % task["size"] + 1, task["odd_col"])
        replies.add(env.answer(*wrong))
        env, _ = started(task)
        replies.add(env.answer(task["odd_row"], task["odd_col"]))
    assert {size: len(texts) for size, texts in seen.items()} == {3: 1, 4: 1}
    assert replies == {"Correct.", "Wrong."}


def test_the_prompt_through_the_engine_is_the_same_wherever_the_odd_cell_is(tiny_tokenizer, tiny_template):
    same_grid = [task for task in ALL if task["task_id"].startswith("odd-3x3-red-circle-")]
    results = run_oracle(SPEC, same_grid[::7], tiny_tokenizer, tiny_template)
    assert len({(t.task["odd_row"], t.task["odd_col"]) for t in results}) > 1
    assert len({tiny_tokenizer.decode(t.tokens.prompt_ids) for t in results}) == 1


def test_a_wrong_answer_scores_nothing_and_ends_the_episode():
    task = ALL[0]
    env, _ = started(task)
    row = task["odd_row"] % task["size"] + 1
    assert env.answer(row, task["odd_col"]) == "Wrong."
    assert env.done and env.reward == 0.0 and env.success is False
    assert env.answer(task["odd_row"], task["odd_col"]) == "The episode is over." and env.reward == 0.0


def test_a_cell_off_the_grid_is_an_error_that_does_not_end_the_episode():
    task = next(t for t in ALL if t["size"] == 3)
    env, _ = started(task)
    assert env.answer(4, 1) == "Error: rows and columns are numbered 1 to 3; got row 4, column 1."
    assert not env.done and env.reward == 0.0
    assert env.answer(task["odd_row"], task["odd_col"]) == "Correct." and env.reward == 1.0 and env.success


@pytest.mark.parametrize("change, message", [({"odd_row": 5}, "outside the 4x4 grid"),
                                             ({"odd_shape": "circle", "odd_color": "red"}, "must differ"),
                                             ({"size": 9}, "not 9x9"),
                                             ({"odd_shape": "star"}, r"Unknown shape or colour \['star'\]")])
def test_reset_refuses_an_impossible_grid(change, message):
    task = {**next(t for t in ALL if t["size"] == 4 and t["shape"] == "circle" and t["color"] == "red"), **change}
    with pytest.raises(ValueError, match=message):
        OddOneOut().reset(**task)


@pytest.mark.parametrize("split", SPEC.splits)
def test_the_reference_policy_solves_every_task_of_a_split(split):
    envs = [play(oracle, task) for task in SPEC.iter_tasks(split, seed=0)]
    assert envs and all(env.reward == 1.0 and env.success for env in envs)
    assert all(env.metrics["looks"] == 1 for env in envs)


def test_the_reference_policy_succeeds_through_the_rollout_engine(tiny_vision_dir):
    tasks = list(itertools.islice(SPEC.iter_tasks("test", seed=0), 24))
    policy = load_policy("oracle", tokenizer=tiny_vision_dir, oracle=SPEC.oracle, device="auto", dtype="auto",
                         backend="hf", max_batch_size=32)
    results = run_oracle(SPEC, tasks, policy.tokenizer, policy.chat_template, processor=policy.processor)
    assert all(t.status == "success" and t.reward == 1.0 for t in results), [(t.id, t.status) for t in results]
    assert all(t.metrics["tool_errors"] == 0 and t.metrics["parse_errors"] == 0 for t in results)
    assert [m["tool_calls"][0]["function"]["name"] for m in results[0].messages if m.get("tool_calls")] == [
        "look", "answer"]


def test_without_pillow_the_env_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    monkeypatch.delitem(sys.modules, "trajlab.env.builtin.odd_one_out")
    with pytest.raises(MissingDependency, match=r"pip install 'trajlab\[vision\]'"):
        load_env("odd_one_out")
