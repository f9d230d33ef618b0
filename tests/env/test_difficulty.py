"""Difficulty knobs of the built-in envs: defaults give today's tasks, each knob moves the tasks it says, splits never
depend on a knob, and a bad knob is refused with the valid ones."""

import itertools
from dataclasses import replace

import pytest

from tests.env.oracle import run_oracle
from trajlab.config import load_config
from trajlab.env import load_env
from trajlab.env.builtin.arithmetic import SYMBOLS
from trajlab.env.builtin.ctf import encoding_layers
from trajlab.env.mixture import load_envs

KNOBBED = ["arithmetic", "ctf", "driving", "guess", "wordle"]


def first(spec, split="train", n=200, seed=0):
    return list(itertools.islice(spec.iter_tasks(split, seed), n))


@pytest.mark.parametrize("name", KNOBBED)
def test_default_knobs_give_the_same_tasks_in_the_same_order(name):
    spec = load_env(name)
    defaults = {knob.name: knob.default for knob in spec.knobs}
    assert defaults, f"{name} declares its knobs"
    same = spec.with_options(**defaults)
    assert same.options == {}
    for split in spec.splits:
        assert first(same, split, seed=3) == first(spec, split, seed=3)


def test_each_knob_moves_the_tasks_it_names():
    arithmetic = first(load_env("arithmetic").with_options(min_operand=10, max_operand=20))
    assert all(10 <= t[k] <= 20 for t in arithmetic for k in "abc")
    assert {t["task_id"] for t in arithmetic}.isdisjoint({t["task_id"] for t in first(load_env("arithmetic"))})
    longer = first(load_env("arithmetic").with_options(operations=4))
    assert all(len(t["ops"]) == 4 and t["question"].startswith("Compute (((") and "e" in t for t in longer)
    one = first(load_env("arithmetic").with_options(operations=1))
    assert all(t["question"] == f"Compute {t['a']} {SYMBOLS[t['ops'][0]]} {t['b']}." and "c" not in t for t in one)

    guess = first(load_env("guess").with_options(min_high=4, max_high=8))
    assert {t["high"] for t in guess} == {4, 8} and all(t["max_guesses"] == t["high"].bit_length() + 1 for t in guess)

    wordle = first(load_env("wordle").with_options(max_guesses=4))
    assert all(t["max_guesses"] == 4 and t["task_id"] == f"wordle-{t['secret']}-g4" for t in wordle)
    assert [t["secret"] for t in wordle] == [t["secret"] for t in first(load_env("wordle"))]

    def hazards(**knobs):
        return {len(t["hazards"]) for t in first(load_env("driving").with_options(**knobs), n=3000)}

    assert hazards() == {1, 2, 3} and hazards(max_hazards=1) == {1} and hazards(min_hazards=3) == {3}

    ctf = first(load_env("ctf").with_options(min_layers=5), n=2000)
    encodings = [t for t in ctf if t["kind"] == "encoding"]
    assert encodings and all(encoding_layers(t["seed"]) == 5 for t in encodings)
    assert {t["kind"] for t in ctf} == {"encoding", "hidden", "cipher", "service"}, "other kinds have no layers"
    all_layers = {encoding_layers(t["seed"]) for t in first(load_env("ctf"), n=2000) if t["kind"] == "encoding"}
    assert all_layers == {3, 4, 5}, "the knobs' bounds are the layers challenges have"


@pytest.mark.parametrize(("name", "knobs"), [("arithmetic", {"max_operand": 20}), ("arithmetic", {"operations": 3}),
                                             ("guess", {"min_high": 4}),
                                             ("driving", {"max_hazards": 2}), ("ctf", {"max_layers": 3})])
def test_a_tasks_split_is_the_same_at_every_difficulty(name, knobs):
    spec, other = load_env(name), load_env(name).with_options(**knobs)
    for split, rest in (("train", "test"), ("test", "train")):
        mine = {t["task_id"] for t in first(other, split, n=3000)}
        assert mine and mine.isdisjoint(t["task_id"] for t in first(spec, rest, n=3000))


@pytest.mark.parametrize(("name", "knobs"), [("arithmetic", {"min_operand": 30, "max_operand": 60}),
                                             ("arithmetic", {"operations": 1}), ("arithmetic", {"operations": 5}),
                                             ("guess", {"min_high": 64}), ("driving", {"min_hazards": 3})])
def test_the_reference_policy_solves_harder_tasks(name, knobs, tiny_tokenizer, tiny_template):
    spec = load_env(name).with_options(**knobs)
    tasks = first(spec, "test", n=20)
    results = run_oracle(spec, tasks, tiny_tokenizer, tiny_template)
    assert all(t.status == "success" for t in results), [(t.id, t.messages[-1]) for t in results]


def test_a_bad_knob_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="no difficulty knob 'max_operands'. Did you mean 'max_operand'.*"
                                         "Its knobs: min_operand, max_operand"):
        load_env("arithmetic").with_options(max_operands=20)
    with pytest.raises(ValueError, match="'max_guesses' is an integer from 1 to 6, got 9"):
        load_env("wordle").with_options(max_guesses=9)
    with pytest.raises(ValueError, match="min_operand 8 is above max_operand 5"):
        load_env("arithmetic").with_options(min_operand=8, max_operand=5)
    with pytest.raises(ValueError, match="driving: min_hazards 3 is above max_hazards 2"):
        load_env("driving").with_options(min_hazards=3, max_hazards=2)
    with pytest.raises(ValueError, match="ctf: min_layers 5 is above max_layers 4"):
        load_env("ctf").with_options(min_layers=5, max_layers=4)
    with pytest.raises(ValueError, match="no range ends between min_high 40 and max_high 50"):
        load_env("guess").with_options(min_high=40, max_high=50)
    with pytest.raises(ValueError, match="Its knobs: none"):
        load_env("odd_one_out").with_options(size=3)


def test_a_mixture_gives_each_knob_to_the_envs_that_have_it_and_mixes_by_weight():
    mixture = load_envs("arithmetic,guess").with_options(max_operand=3, min_high=4, max_high=8)
    assert mixture.specs["arithmetic"].options == {"max_operand": 3}
    assert mixture.specs["guess"].options == {"min_high": 4, "max_high": 8} and mixture.weights is None
    with pytest.raises(ValueError, match=r"No env of the mixture arithmetic,guess has the difficulty knob\(s\) "
                                         r"\['max_hazards'\]"):
        mixture.with_options(max_hazards=1)

    weighted = replace(load_envs("arithmetic,guess"), weights={"arithmetic": 2, "guess": 1})
    assert [t["env"] for t in itertools.islice(weighted.iter_tasks("train", seed=0), 9)] == ["arithmetic", "arithmetic",
                                                                                     "guess"] * 3
    with pytest.raises(ValueError, match="positive share"):
        replace(weighted, weights={"arithmetic": 1})


def test_a_run_configs_difficulty_sets_the_envs_knobs(tmp_path):
    config = load_config(None, {"env": "arithmetic", "difficulty": {"max_operand": 30}})
    assert config.env_spec().options == {"max_operand": 30}
    with pytest.raises(ValueError, match="Did you mean 'max_operand'"):
        load_config(None, {"env": "arithmetic", "difficulty": {"max_opernd": 30}}).env_spec()
