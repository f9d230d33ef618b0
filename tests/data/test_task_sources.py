"""Tasks from datasets (the ``tasks:`` section): Parquet, JSON Lines, a ``save_to_disk`` folder and a dataset name in
an offline Hugging Face cache, each loaded by ``datasets``, mapped to arithmetic's task fields and run by the real env
with the tiny model through the CLI."""

import itertools
import json
import shutil
from pathlib import Path

import datasets
import pytest
import yaml
from typer.testing import CliRunner

from trajlab.cli import app
from trajlab.config import ConfigError, TasksSettings, load_config
from trajlab.data.datasets import rl_dataset, save_dataset
from trajlab.data.store import read_trajectories
from trajlab.env import load_env
from trajlab.train.curriculum import Curriculum, build_stages

ARITHMETIC = load_env("arithmetic")
ROWS = list(itertools.islice(ARITHMETIC.iter_tasks("train", 0), 12))
"""Arithmetic's own tasks, as its generator gives them."""


def _renamed(rows: list[dict]) -> list[dict]:
    """The rows as a dataset of someone else's would hold them: other column names, and a column the env lacks."""
    return [{"problem": r["question"], "solution": r["answer"], "origin": "handmade",
             **{k: v for k, v in r.items() if k not in ("question", "answer")}} for r in rows]


MAPPING = {"columns": {"problem": "question", "solution": "answer"}, "keep": ["task_id", "a", "b", "c", "ops"]}


@pytest.fixture
def parquet(tmp_path) -> Path:
    path = tmp_path / "tasks.parquet"
    datasets.Dataset.from_list(_renamed(ROWS)).to_parquet(str(path))
    return path


def _env(tasks: dict, env: str | list[str] = "arithmetic"):
    return load_config(None, {"env": env, "tasks": tasks}).env_spec()


def test_parquet_with_a_mapping_and_a_test_fraction_gives_the_envs_own_rows(parquet):
    env = _env({"source": str(parquet), **MAPPING, "test_fraction": 0.25})
    train, test = list(env.iter_tasks("train", 0)), list(env.iter_tasks("test", 0))
    assert (len(train), len(test)) == (9, 3) and env.splits == ("train", "test")
    by_id = {row["task_id"]: row for row in ROWS}
    assert all(task == by_id[task["task_id"]] for task in train + test), "mapped back to the generator's exact rows"
    assert {t["task_id"] for t in train}.isdisjoint(t["task_id"] for t in test)
    again = _env({"source": str(parquet), **MAPPING, "test_fraction": 0.25})
    assert list(again.iter_tasks("test", 5)) != test or len(test) < 2, "another seed, another order"
    assert sorted(map(str, again.iter_tasks("test", 5))) == sorted(map(str, test)), "the same rows held out"
    assert list(again.iter_tasks("train", 0)) == train, "the same seed, the same order"
    in_order = _env({"source": str(parquet), **MAPPING, "shuffle": False})
    assert [t["task_id"] for t in in_order.iter_tasks("train", 3)] == [r["task_id"] for r in ROWS]
    direct = TasksSettings(source=str(parquet), **MAPPING, test_fraction=0.25).apply(ARITHMETIC)
    assert list(direct.iter_tasks("test", 0)) == test, "the Python API is the config's section"
    episode = ARITHMETIC.make()
    assert episode.reset(**train[0]) == train[0]["question"], "the env takes the mapped row as its task"


def test_jsonl_files_per_split_and_a_saved_datasets_folder(tmp_path):
    for split, rows in (("train", ROWS[:8]), ("test", ROWS[8:])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _renamed(rows)))
    env = _env({"source": {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl")}, **MAPPING})
    assert sorted(t["task_id"] for t in env.iter_tasks("test", 0)) == sorted(r["task_id"] for r in ROWS[8:])
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:8]),
                          "validation": datasets.Dataset.from_list(ROWS[8:])}).save_to_disk(str(saved))
    env = _env({"source": str(saved), "splits": {"train": "train", "test": "validation"}})
    assert sorted(t["task_id"] for t in env.iter_tasks("test", 0)) == sorted(r["task_id"] for r in ROWS[8:])
    assert len(list(env.iter_tasks("train", 0))) == 8


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_dataset_written_by_trajlab_dataset_kind_rl_gives_back_its_tasks(tmp_path, suffix):
    written = save_dataset(rl_dataset(ROWS, env="arithmetic", split="train"), tmp_path / f"rl{suffix}")
    env = _env({"source": str(written), "shuffle": False})
    assert list(env.iter_tasks("train", 0)) == ROWS


def _cache_named(cache: Path, build: Path, rows: list[dict]) -> None:
    """``trajlab-test/arith`` in a datasets cache as ``load_dataset`` leaves a Hub dataset there: prepared Arrow
    files and their info under ``trajlab-test___arith/<config>/<version>/<hash>``. Built offline by the Parquet
    builder, then moved and renamed to where and what a download would have written."""
    source = build / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(source))
    builder = datasets.load_dataset_builder("parquet", data_files={"train": str(source)}, cache_dir=str(build))
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)
    target = cache / "trajlab-test___arith" / "default" / "0.0.0" / prepared.name
    shutil.copytree(prepared, target)
    for arrow in target.glob("parquet-*"):
        arrow.rename(arrow.with_name(arrow.name.replace("parquet-", "arith-", 1)))


def test_a_dataset_name_loads_from_the_offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "datasets"
    _cache_named(cache, tmp_path / "build", _renamed(ROWS))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    env = _env({"source": "trajlab-test/arith", **MAPPING, "test_fraction": 0.5})
    assert sorted(t["task_id"] for t in itertools.chain(env.iter_tasks("train", 0), env.iter_tasks("test", 0))) == (
        sorted(r["task_id"] for r in ROWS))
    with pytest.raises(ValueError, match=r"'trajlab-test/other' is no file here.*datasets cache"):
        _env({"source": "trajlab-test/other"})


def test_each_mistake_is_one_clear_line(parquet, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.parquet: no such task file"):
        _env({"source": str(tmp_path / "missing.parquet")})
    with pytest.raises(ValueError, match=r"no column 'problme'.*its columns: problem, solution, origin, task_id"):
        _env({"source": str(parquet), "columns": {"problme": "question"}})
    with pytest.raises(ValueError, match=r"tasks.columns gives a task two fields named answer"):
        _env({"source": str(parquet), "columns": {"problem": "answer", "solution": "answer"}})
    with pytest.raises(ValueError, match=r"two fields named a \(two columns mapped to it, or one mapped onto a"):
        _env({"source": str(parquet), "columns": {"problem": "a"}})
    with pytest.raises(ValueError, match=r"no split 'validation' \(for trajlab's 'test'.*its splits: train\."):
        _env({"source": str(parquet), **MAPPING, "splits": {"train": "train", "test": "validation"}})
    with pytest.raises(ValueError, match=r"train row 1: not a valid arithmetic task: "
                       r"missing field 'answer'.*'question'"):
        _env({"source": str(parquet)})
    bad = _renamed(ROWS)
    del bad[4]["solution"]  # the JSON loader fills the hole with null, which the env's tasks never hold
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(ValueError, match=r"bad\.jsonl, train row 5: not a valid arithmetic task: "
                       r"field 'answer' is a null"):
        _env({"source": str(tmp_path / "bad.jsonl"), **MAPPING})
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "one.jsonl").write_text(json.dumps(_renamed(ROWS)[0]) + "\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: split 'test' has no rows"):
        _env({"source": {"train": str(tmp_path / "one.jsonl"), "test": str(tmp_path / "empty.jsonl")}, **MAPPING})
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(tmp_path / "none.parquet"))  # a schema, no rows
    with pytest.raises(ValueError, match=r"none\.parquet: split 'train' has no rows"):
        _env({"source": str(tmp_path / "none.parquet")})
    with pytest.raises(ValueError, match="has splits \\['train'\\], not 'test' \\(its tasks come from"):
        next(iter(_env({"source": str(parquet), **MAPPING}).iter_tasks("test", 0)))
    (tmp_path / "twice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _renamed([*ROWS, ROWS[1]])))
    with pytest.raises(ValueError, match=r"twice\.jsonl: train row 2 and train row \d+ are the same task"):
        _env({"source": str(tmp_path / "twice.jsonl"), **MAPPING})
    with pytest.raises(ConfigError, match=r"tasks.colums: unknown key \(did you mean 'columns'\?\)"):
        _env({"source": str(parquet), "colums": {}})
    with pytest.raises(ConfigError, match="difficulty sets the env's task generator"):
        load_config(None, {"env": "arithmetic", "difficulty": {"max_operand": 5},
                           "tasks": {"source": str(parquet), **MAPPING}}).env_spec()


def test_a_mixed_dataset_routes_each_row_to_the_env_it_names(tmp_path):
    guess = list(itertools.islice(load_env("guess").iter_tasks("train", 0), 4))
    rows = [{**r, "env": "arithmetic"} for r in ROWS[:4]] + [{**r, "env": "guess"} for r in guess]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixture = _env({"source": str(tmp_path / "mixed.jsonl")}, env=["arithmetic", "guess"])
    drawn = list(mixture.iter_tasks("train", 0))
    assert sorted((t["env"], t["task_id"]) for t in drawn) == sorted((r["env"], r["task_id"]) for r in rows)
    with pytest.raises(ValueError, match=r"train row 5: the task is for env 'guess' but runs in 'arithmetic'"):
        _env({"source": str(tmp_path / "mixed.jsonl")})


def test_rl_and_a_curriculum_stage_draw_their_tasks_from_the_dataset(parquet):
    tasks = {"source": str(parquet), **MAPPING, "test_fraction": 0.25}
    config = load_config(None, {"env": "arithmetic", "tasks": tasks,
                                "curriculum": {"stages": [{"name": "one", "task_filter": {"a": [1, 2, 3]}}]}})
    env = config.env_spec()
    _, drawn = Curriculum.single(env, {}, seed=1).draw(0, 20)
    train = {t["task_id"] for t in env.iter_tasks("train", 0)}
    assert {t["task_id"] for t in drawn} == train, "every train row, cycled, and no other task"
    (stage,) = build_stages(config.curriculum, env, config.rollout)
    _, staged = Curriculum([stage], seed=1).draw(0, 20)
    wanted = {t["task_id"] for t in env.iter_tasks("train", 0) if t["a"] in (1, 2, 3)}
    assert wanted and wanted != train, "the filter picks some rows, not all"
    assert {t["task_id"] for t in staged} == wanted, "the stage draws the dataset rows its filter picks"


def test_trajlab_run_collects_trains_and_evaluates_on_a_parquet_file(parquet, tmp_path):
    """collect (oracle), rl and eval of `trajlab run`, each on the dataset's rows of its split, with the tiny model."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "env": "arithmetic", "stages": ["collect", "rl", "eval"],
        "tasks": {"source": str(parquet), **MAPPING, "test_fraction": 0.25},
        "rollout": {"max_turns": 4, "max_new_tokens": 32, "concurrency": 8},
        "collect": {"episodes": 4}, "rl": {"steps": 1, "tasks_per_step": 2, "group_size": 2},
        "eval": {"num_tasks": 3}}))
    result = CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    env = _env({"source": str(parquet), **MAPPING, "test_fraction": 0.25})
    train, test = ({t["task_id"]: t for t in env.iter_tasks(split, 0)} for split in ("train", "test"))
    demos = list(read_trajectories(tmp_path / "run" / "demos.jsonl"))
    assert len(demos) == 4 and all(t.task == train[t.task["task_id"]] and t.status == "success" for t in demos)
    rollouts = list(read_trajectories(tmp_path / "run" / "rl" / "rollouts.jsonl"))
    assert rollouts and all(t.task == train[t.task["task_id"]] for t in rollouts)
    (evaluated,) = (tmp_path / "run").glob("eval-0-*")
    assert {t.task["task_id"] for t in read_trajectories(evaluated / "trajectories.jsonl")} == set(test)


def test_trajlab_run_refuses_a_split_its_stages_draw_before_the_first_stage(parquet, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "env": "arithmetic",
                                      "stages": ["collect", "eval"], "tasks": {"source": str(parquet), **MAPPING}}))
    result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 1 and "has splits ['train'], not 'test' (its tasks come from" in result.stdout
    assert not (tmp_path / "run" / "demos.jsonl").exists() and not (tmp_path / "run" / "model").exists()


def test_eval_on_the_cli_takes_the_tasks_section_and_tasks_file_still_wins(parquet, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"env": "arithmetic", "tasks": {"source": str(parquet), **MAPPING,
                                                                      "test_fraction": 0.25}}))
    runner = CliRunner()
    result = runner.invoke(app, ["eval", "--policy", "oracle", "--out", str(tmp_path / "e"), "--config", str(config),
                                 "--num-tasks", "3"], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    held_out = {t["task_id"] for t in _env({"source": str(parquet), **MAPPING, "test_fraction": 0.25})
                .iter_tasks("test", 0)}
    evaluated = list(read_trajectories(tmp_path / "e" / "trajectories.jsonl"))
    assert {t.task["task_id"] for t in evaluated} == held_out and all(t.status == "success" for t in evaluated)
    (tmp_path / "one.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    result = runner.invoke(app, ["eval", "--policy", "oracle", "--out", str(tmp_path / "f"), "--config", str(config),
                                 "--tasks", str(tmp_path / "one.jsonl")], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    assert [t.task["task_id"] for t in read_trajectories(tmp_path / "f" / "trajectories.jsonl")] == [ROWS[0]["task_id"]]
    result = runner.invoke(app, ["eval", "--policy", "oracle", "--out", str(tmp_path / "g"), "--env", "arithmetic",
                                 "--set", f"tasks.source={tmp_path / 'nope.parquet'}"])
    assert result.exit_code == 1 and "error:" in result.stdout and "nope.parquet: no such task file" in result.stdout


def test_a_row_of_a_kind_the_env_has_not_is_refused_before_any_episode(tmp_path):
    """A ctf row of an unknown kind passed the type check and failed every episode at reset (exit 0, all errors)."""
    source = tmp_path / "ctf.jsonl"
    source.write_text(json.dumps({"kind": "cipher", "seed": 2}) + "\n" + json.dumps({"kind": "nosuch", "seed": 1}))
    with pytest.raises(ValueError, match=r"train row 2: not a valid ctf task: field 'kind' is 'nosuch', not one of "
                                         r"'encoding', 'hidden', 'cipher', 'service'"):
        TasksSettings(source=str(source)).apply(load_env("ctf"))
