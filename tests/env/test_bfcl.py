import asyncio
import itertools
import json
import random
import subprocess
import sys
import textwrap
import time

import pydantic
import pytest
from transformers.utils import get_json_schema

from trajlab.chat.parsers import get_parser
from trajlab.env.base import bind_tool, tool_names
from trajlab.env.builtin import bfcl_data
from trajlab.env.builtin.bfcl import (
    BFCL,
    OWNER,
    SPEC,
    TOOL_SCHEMAS,
    ground_truth_steps,
    replay,
    split_of_index,
)
from trajlab.env.builtin.bfcl_data import (
    CATEGORIES,
    Call,
    entries,
    ground_truth_calls,
    held_out_functions,
    load_entry,
)
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode

from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT  # isort: skip (after trajlab sets BFCL_PROJECT_ROOT)
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # isort: skip
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (  # isort: skip
    multi_turn_checker,
    multi_turn_irrelevance_checker,
)

ALL = [entry for category in CATEGORIES for entry in entries(category)]
BFCL_TYPES = {"dict", "float", "tuple", "any"}


def task(entry, **options):
    return {"task_id": entry.id, "category": entry.category, **options}


def gt_turns(entry):
    return [list(calls) for calls in ground_truth_calls(entry.id)]


def as_steps(turns):
    """Per user turn, one model turn making all its calls (or none), as the reference policy plays it."""
    return [[calls] if calls else [] for calls in turns]


# --- Official verdicts, computed by bfcl_eval on the same call sequence ---

_fresh_names = itertools.count()


def official_verdicts(entry, steps):
    """(``multi_turn_checker`` valid, and also ``multi_turn_irrelevance_checker`` valid) for one entry.

    The checker keeps instances in module globals keyed by model name and entry id: a fresh name per call keeps
    entries apart, and its instances are deleted afterwards.
    """
    decoded = [[[call.source() for call in step] for step in turn] for turn in steps]
    model_name = f"trajlab_agreement_{next(_fresh_names)}"
    prompt = {"id": entry.id, "initial_config": entry.initial_config, "involved_classes": entry.involved_classes}
    try:
        valid = multi_turn_checker(decoded, entry.ground_truth, prompt, f"multi_turn_{entry.category}",
                                   model_name)["valid"]
    finally:
        for key in [key for key in vars(multi_turn_utils) if key.startswith(model_name)]:
            delattr(multi_turn_utils, key)
    return valid, valid and multi_turn_irrelevance_checker(decoded, entry.ground_truth)["valid"]


def callable_at(entry, turn):
    """Functions the model may call in user turn ``turn``: its backends' minus the held-out ones not yet announced."""
    later = {name for at, names in held_out_functions(entry).items() if at > turn for name in names}
    return {name for owner in entry.involved_classes for name in bfcl_data.functions_of(owner)} - later


def changed(value, rng):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + rng.choice([1, 2.5])
    if isinstance(value, str):
        return value + rng.choice(["_x", "1"])
    if isinstance(value, list):
        return value[:-1] if value else ["x"]
    if isinstance(value, dict):
        return {**value, "x": 1}
    return "x"


def perturbed(entry, kind):
    """The ground truth with one call dropped, one argument changed, or one call added (seeded by the entry id)."""
    rng = random.Random(f"{kind}:{entry.id}")
    turns = gt_turns(entry)
    if kind == "drop":
        t, i = rng.choice([(t, i) for t, calls in enumerate(turns) for i in range(len(calls))])
        del turns[t][i]
    elif kind == "change":
        t, i = rng.choice([(t, i) for t, calls in enumerate(turns) for i, c in enumerate(calls) if c.arguments])
        call = turns[t][i]
        key = rng.choice(sorted(call.arguments))
        turns[t][i] = Call(call.name, {**call.arguments, key: changed(call.arguments[key], rng)})
    elif kind == "extra":  # a call of the entry's own ground truth, repeated somewhere it can be made
        t = rng.randrange(len(turns))
        pool = [call for calls in gt_turns(entry) for call in calls if call.name in callable_at(entry, t)]
        turns[t].insert(rng.randint(0, len(turns[t])), rng.choice(pool))
    return as_steps(turns)


@pytest.mark.parametrize("kind", ["none", "drop", "change", "extra"])
def test_verdicts_agree_with_bfcl_eval_on_all_800_entries(kind):
    """Ground truth scores 1.0 everywhere; perturbed sequences get bfcl_eval's own verdict, entry by entry.

    trajlab's default scoring also requires no call in a turn with empty ground truth (the irrelevance check), so it
    is compared with ``multi_turn_checker`` and ``multi_turn_irrelevance_checker`` together; with
    ``check_irrelevance=False`` it is compared with ``multi_turn_checker`` alone, the leaderboard's rule.
    """
    started = time.perf_counter()
    agree = {"default": 0, "leaderboard": 0}
    valid = {"checker": 0, "checker+irrelevance": 0}
    for entry in ALL:
        steps = as_steps(gt_turns(entry)) if kind == "none" else perturbed(entry, kind)
        checker, checker_and_irrelevance = official_verdicts(entry, steps)
        strict = replay(task(entry), steps)
        lenient = replay(task(entry, check_irrelevance=False), steps)
        if kind == "none":
            assert strict.reward == 1.0 and strict.success and strict.done, entry.id
            assert checker and checker_and_irrelevance, entry.id
        assert strict.success == checker_and_irrelevance, (entry.id, strict._solved, steps)
        assert lenient.success == checker, (entry.id, lenient._solved, steps)
        agree["default"] += strict.success == checker_and_irrelevance
        agree["leaderboard"] += lenient.success == checker
        valid["checker"] += checker
        valid["checker+irrelevance"] += checker_and_irrelevance
    print(f"bfcl agreement ({kind}): default {agree['default']}/{len(ALL)}, leaderboard "
          f"{agree['leaderboard']}/{len(ALL)}; bfcl_eval valid {valid}; {time.perf_counter() - started:.1f}s")
    assert not [key for key in vars(multi_turn_utils) if key.startswith("trajlab_agreement_")]


# --- The env's own behaviour ---


def test_tools_are_the_128_backend_functions_with_converted_schemas():
    names = tool_names(BFCL)
    assert len(names) == 128 and sorted(OWNER) == names
    assert sorted(bfcl_data.BACKEND_CLASSES) == sorted(set(OWNER.values()))
    assert [t["function"]["name"] for t in SPEC.tools] == names

    def types(schema):
        found = {schema["type"]} if "type" in schema else set()
        for child in [*schema.get("properties", {}).values(), *([schema["items"]] if "items" in schema else [])]:
            found |= types(child)
        return found

    seen = set().union(*(types(t["function"]["parameters"]) for t in SPEC.tools))
    assert seen <= {"object", "string", "integer", "number", "boolean", "array"} and not seen & BFCL_TYPES
    updates = TOOL_SCHEMAS["edit_ticket"]["function"]["parameters"]["properties"]["updates"]
    assert updates["type"] == "object" and updates["properties"]["priority"]["type"] == "integer"
    assert TOOL_SCHEMAS["tail"]["function"]["parameters"]["properties"]["lines"]["default"] == 10
    assert TOOL_SCHEMAS["find"]["function"]["parameters"]["properties"]["name"]["default"] is None

    env = BFCL()
    for name in names:  # TRL builds its schemas from the methods: same arguments, same required ones
        ours, theirs = TOOL_SCHEMAS[name]["function"], get_json_schema(getattr(env, name))["function"]
        assert list(theirs["parameters"]["properties"]) == list(bfcl_data.method_signature(name).parameters)[1:]
        assert set(theirs["parameters"]["properties"]) == set(ours["parameters"]["properties"])
        assert sorted(theirs["parameters"].get("required", [])) == sorted(ours["parameters"]["required"])


def test_arguments_reach_the_backend_as_sent():
    """As in BFCL, which evals the call: an int for a float parameter stays an int (no pydantic coercion)."""
    entry = next(e for e in entries("base") if "TradingBot" in e.involved_classes)
    env = BFCL()
    env.reset(**task(entry))
    seen = []
    env._model["TradingBot"].fund_account = lambda amount: seen.append(amount) or {"ok": True}
    assert bind_tool(env, "fund_account")(amount=100) == '{"ok": true}'
    assert seen == [100] and type(seen[0]) is int
    assert bind_tool(env, "fund_account")(amount="100") == '{"ok": true}' and seen[1] == "100"
    with pytest.raises(pydantic.ValidationError, match="Missing required argument"):
        bind_tool(env, "fund_account")(money=100)


def test_splits_share_entry_indices_across_categories_and_tasks_are_small():
    by_split = {split: list(SPEC.iter_tasks(split, seed=0)) for split in SPEC.splits}
    ids = [t["task_id"] for split in by_split.values() for t in split]
    assert len(ids) == len(set(ids)) == 800
    for split, rows in by_split.items():
        assert all(set(row) == {"task_id", "category"} for row in rows)
        indices = {int(row["task_id"].rsplit("_", 1)[1]) for row in rows}
        assert all(split_of_index(i) == split for i in indices)
        assert len(rows) == 4 * len(indices), "entry i of every category is in the same split"
    assert [len(rows) // 4 for rows in by_split.values()] == [sum(split_of_index(i) == s for i in range(200))
                                                                for s in SPEC.splits]
    assert 0.05 < len(by_split["validation"]) / 800 < 0.2 and 0.12 < len(by_split["test"]) / 800 < 0.3
    assert [t["task_id"] for t in SPEC.iter_tasks("test", seed=1)] != [t["task_id"] for t in by_split["test"]]
    assert [t["task_id"] for t in SPEC.iter_tasks("test", seed=0)] == [t["task_id"] for t in by_split["test"]]


def test_two_episodes_of_one_entry_share_no_state_and_bfcl_globals_stay_untouched():
    before = set(vars(multi_turn_utils))
    entry = load_entry("multi_turn_base_0")
    first, second = BFCL(), BFCL()
    assert first.reset(**task(entry)) == second.reset(**task(entry))
    for env in (first, second):
        env.cd(folder="document")
    first.mkdir(dir_name="temp")
    assert "temp" in first.ls() and "temp" not in second.ls()
    assert "temp" not in str(first._truth["GorillaFileSystem"].root), "ground-truth instances are separate"
    assert first.next_user_message("Done.") == second.next_user_message("Done.") == entry.question[1][0]["content"]
    assert first._solved == [False] == second._solved  # neither moved final_report.pdf: ground truth ran in each
    assert set(vars(multi_turn_utils)) == before, "bfcl_eval's module-global instance cache is never used"


def test_oracle_solves_a_sample_through_the_rollout_engine(tiny_tokenizer, tiny_template):
    tasks = [t for category in CATEGORIES for t in
             itertools.islice((t for t in SPEC.iter_tasks("test", seed=0) if t["category"] == category), 3)]
    results = run(tasks, tiny_tokenizer, tiny_template)
    assert len(results) == 12
    for trajectory in results:
        entry = load_entry(trajectory.task["task_id"])
        assert trajectory.status == "success" and trajectory.reward == 1.0, (trajectory.id, trajectory.error)
        assert trajectory.stop_reason == "env_done" and trajectory.metrics["tool_errors"] == 0
        assert trajectory.metrics["env/turns_solved"] == trajectory.metrics["env/user_turns"] == len(entry.question)
        # each user turn's credit lands on the answer that ended it
        answers = [m for m in trajectory.messages if m["role"] == "assistant" and not m.get("tool_calls")]
        credited = [reward for reward in trajectory.turn_rewards if reward]
        assert len(answers) == len(credited) == len(entry.question)
        assert sum(trajectory.turn_rewards) == pytest.approx(1.0)
        offered = {t["function"]["name"] for t in trajectory.tools}
        assert offered == callable_at(entry, 0)


def test_the_one_call_reference_plays_the_same_calls_through_llama_3_2s_template():
    """Llama 3.2's template raises on a message with more than one call: the one_call_at_a_time reference plays the
    ground truth a call per message, through the real template and tokenizer, and solves what fits BFCL's 20 steps
    per user turn."""
    from trajlab.chat.template import resolve_chat_template
    from trajlab.models.families import load_family_tokenizer

    tokenizer = load_family_tokenizer("llama3.2")
    tasks = [t for category in CATEGORIES for t in
             itertools.islice((t for t in SPEC.iter_tasks("test", seed=0) if t["category"] == category), 2)]
    results = run(tasks, tokenizer, resolve_chat_template(tokenizer), oracle=SPEC.references["one_call_at_a_time"])
    for trajectory in results:
        longest = max(map(len, ground_truth_calls(trajectory.task["task_id"])))
        assert all(len(m.get("tool_calls") or []) <= 1 for m in trajectory.messages if m["role"] == "assistant")
        assert trajectory.metrics["tool_calls"] == sum(map(len, ground_truth_calls(trajectory.task["task_id"])))
        if longest < MAXIMUM_STEP_LIMIT:
            assert trajectory.status == "success" and trajectory.reward == 1.0, (trajectory.id, trajectory.error)


def run(tasks, tokenizer, template, max_turns=64, oracle=SPEC.oracle):
    """The reference policy through the rollout engine, with limits BFCL episodes need (up to 8 user turns, long
    tool outputs in long_context, up to 34 calls in one message)."""
    engine = RolloutEngine(SPEC, ScriptedGenerator(oracle, tokenizer, template), tokenizer,
                           chat_template=template, parser=get_parser("auto", tokenizer),
                           limits=dict(max_turns=max_turns, max_episode_tokens=200_000, max_new_tokens=4096), seed=0)
    return asyncio.run(engine.run([Episode(t["task_id"], t) for t in tasks], concurrency=4, retries=0,
                                  retry_backoff_s=1.0))


def test_held_out_function_is_unknown_until_its_turn_then_announced_and_callable(tiny_tokenizer, tiny_template):
    entry = load_entry("multi_turn_miss_func_0")
    assert entry.missed_function == {3: ["sort"]} and entry.question[3] == []
    [trajectory] = run([task(entry)], tiny_tokenizer, tiny_template)
    assert "sort" not in {t["function"]["name"] for t in trajectory.tools}
    assert '"sort"' not in tiny_tokenizer.decode(trajectory.tokens.prompt_ids)
    users = [m["content"] for m in trajectory.messages if m["role"] == "user"]
    assert users[3].endswith("I have updated some more functions you can choose from. What about now?")
    assert json.loads(users[3].splitlines()[0]) == [TOOL_SCHEMAS["sort"]]
    assert trajectory.reward == 1.0

    env = BFCL()
    env.reset(**task(entry))
    assert env.sort(file_name="final_report.pdf") == "Error: function 'sort' is not available in this conversation."
    assert "sort" not in {t["function"]["name"] for t in env.episode_tools}
    for _ in range(3):
        message = env.next_user_message("ok")
    assert "sort" in {t["function"]["name"] for t in env.episode_tools} and json.loads(message.splitlines()[0])
    assert not env.sort(file_name="final_report.pdf").startswith("Error: function")


def test_a_function_the_ground_truth_calls_before_its_announcement_is_offered_from_the_start():
    entry = load_entry("multi_turn_miss_func_49")  # holds out tail until turn 3, calls it in turn 1
    assert entry.missed_function == {3: ["wc", "tail", "cat"]}
    assert held_out_functions(entry) == {3: ["wc", "cat"]}
    env = BFCL()
    env.reset(**task(entry))
    assert "tail" in {t["function"]["name"] for t in env.episode_tools}


def test_the_step_limit_force_advances_the_turn_and_counts_it_failed():
    assert BFCL.max_steps_per_turn == MAXIMUM_STEP_LIMIT == 20
    entry = load_entry("multi_turn_base_0")
    truth = gt_turns(entry)
    env = BFCL()
    first = env.reset(**task(entry, max_steps_per_turn=2))
    assert first == entry.question[0][0]["content"]
    steps = [[call] for call in truth[0]] + [[Call("pwd", {})]] * 3
    replies = []
    for step in steps[:3]:
        for call in step:
            getattr(env, call.name)(**call.arguments)
        replies.append(env.next_user_message(None))
    assert replies[:2] == [None, None] and replies[2] == entry.question[1][0]["content"]
    assert env.metrics["force_advanced"] == 1 and env._solved == [False] and env.turn_rewards == [0.0]

    # the right calls one per step, then one step too many: the state is right, the turn still fails
    turns = [[[call] for call in truth[0]] + [[Call("pwd", {})]]] + as_steps(truth[1:])
    ended = replay(task(entry, max_steps_per_turn=3), turns)
    assert ended.done and ended.success is False and ended._solved == [False, True, True, True]
    assert ended.reward == pytest.approx(3 / 4) and ended.turn_rewards == [0.0, 0.25, 0.25, 0.25]
    assert replay(task(entry, max_steps_per_turn=4), turns).success


def test_a_turn_never_reached_counts_as_failed(tiny_tokenizer, tiny_template):
    entry = load_entry("multi_turn_base_0")
    users = len(entry.question)
    [trajectory] = run([task(entry)], tiny_tokenizer, tiny_template, max_turns=4)  # two user turns, two turns each
    assert trajectory.stop_reason == "max_turns" and trajectory.status == "truncated"
    assert trajectory.reward == pytest.approx(2 / users) and trajectory.metrics["env/turns_solved"] == 2
    assert trajectory.turn_rewards == [0.0, pytest.approx(1 / users)] * 2


def test_turns_with_empty_ground_truth_are_solved_by_not_calling():
    entry = next(e for e in entries("miss_param") if any(not calls for calls in e.ground_truth))
    empty = next(t for t, calls in enumerate(entry.ground_truth) if not calls)
    truth = gt_turns(entry)
    assert replay(task(entry), as_steps(truth)).success
    noisy = as_steps(truth)
    noisy[empty] = [[Call("pwd", {}) if "GorillaFileSystem" in entry.involved_classes else truth[0][0]]]
    strict = replay(task(entry), noisy)
    assert strict._solved[empty] is False and not strict.success and strict.reward < 1
    lenient = replay(task(entry, check_irrelevance=False), noisy)
    assert lenient._solved[empty] is True
    assert official_verdicts(entry, noisy)[0] == lenient.success


def test_a_turn_without_calls_fails_when_the_ground_truth_has_some():
    entry = load_entry("multi_turn_base_0")
    env = replay(task(entry), [[]] + as_steps(gt_turns(entry)[1:]))
    assert env._solved[0] is False and not official_verdicts(entry, [[]] + as_steps(gt_turns(entry)[1:]))[0]


def test_ground_truth_steps_is_what_the_oracle_plays():
    entry = load_entry("multi_turn_miss_param_3")
    assert ground_truth_steps(entry.id) == as_steps(gt_turns(entry))


def test_under_trl_the_final_answer_scores_the_first_turn():
    """TRL runs one user turn and never ends it; trajlab's reward hands the env the answer, as the engine does."""
    from trajlab.env.trl import env_reward

    entry = load_entry("multi_turn_base_0")
    solved, silent, still_calling = BFCL(), BFCL(), BFCL()
    for env in (solved, silent, still_calling):
        env.reset(**task(entry))
    for call in ground_truth_calls(entry.id)[0]:
        getattr(solved, call.name)(**call.arguments)
        getattr(still_calling, call.name)(**call.arguments)
    answered = [{"role": "assistant", "content": "Done."}]
    calling = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "ls"}}]},
               {"role": "tool", "content": "..."}]
    rewards = env_reward([solved, silent, still_calling], completions=[answered, answered, calling])
    assert rewards == [pytest.approx(1 / len(entry.question)), 0.0, 0.0]


WITHOUT_BFCL_EVAL = "import sys\nsys.modules['bfcl_eval'] = None  # as if bfcl-eval were not installed\n"
INSTALL_LINE = ("The bfcl environment needs the 'bfcl_eval' package, which is not installed: pip install --no-deps "
                "bfcl-eval==2026.3.23 mpmath filelock (--no-deps: bfcl-eval declares about 150 dependencies it does "
                "not use)")


def python(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_without_bfcl_eval_the_other_envs_load_and_bfcl_says_what_to_install():
    out = python(WITHOUT_BFCL_EVAL + textwrap.dedent("""
        from trajlab.env import load_env
        from trajlab.errors import MissingDependency
        for name in ("arithmetic", "driving", "guess", "wordle"):
            assert load_env(name).tools
        try:
            load_env("bfcl")
        except MissingDependency as exc:
            print(exc)
    """))
    assert out == INSTALL_LINE + "\n"


def test_the_registry_and_the_other_envs_never_import_bfcl_eval():
    out = python(textwrap.dedent("""
        import sys
        import trajlab, trajlab.cli
        from trajlab.env import load_env, registered_names
        for name in registered_names():
            if name != "bfcl":
                load_env(name).tools
        print("bfcl_eval" in sys.modules)
    """))
    assert out == "False\n"
