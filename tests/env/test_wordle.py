import statistics
from importlib import resources

import pytest

from tests.env.oracle import run_oracle
from trajlab.env.builtin.wordle import SPEC, WORDS, feedback


def new_game(secret="apple", max_guesses=6):
    env = SPEC.make()
    env.reset(task_id=f"wordle-{secret}", secret=secret, max_guesses=max_guesses)
    return env


@pytest.mark.parametrize(
    ("secret", "guess", "marks"),
    [
        ("crane", "crane", "GGGGG"),
        ("apple", "paper", "YYGY."),  # both p's of the guess match a p of the secret: one green, one yellow
        ("apple", "eerie", "....G"),  # the secret's only e goes to the green; the earlier e's get nothing
        ("speed", "eerie", "YY..."),  # two e's in the secret: two yellows, the third e gets nothing
        ("eerie", "speed", "..YY."),
        ("hello", "llama", "YY..."),
        ("stare", "tears", "YYGGY"),
    ],
)
def test_feedback_marks_greens_first_then_yellows_up_to_the_letter_count(secret, guess, marks):
    assert feedback(secret, guess) == marks


def test_a_guess_gets_its_marks_in_a_line_and_in_words():
    env = new_game("apple")
    reply = env.guess("paper")
    assert reply.splitlines() == [
        "PAPER -> Y Y G Y .",
        "Right spot: P. Wrong spot: P, A, E. Not in the word: R.",
        "5 guesses left.",
    ]
    assert "No more copies of: E." in env.guess("eerie")
    assert env.metrics == {"guesses": 2, "invalid_guesses": 0, "best_greens": 1}
    assert not env.done and env.reward == 0.0 and env.turn_rewards == [0.0, 0.0]


@pytest.mark.parametrize(("word", "problem"), [("pear", "5 letters"), ("apples", "5 letters"), ("ab1de", "a-z"),
                                               ("two w", "a-z"), ("zzzzz", "not in the word list")])
def test_an_invalid_guess_is_explained_and_does_not_count(word, problem):
    env = new_game("apple")
    reply = env.guess(word)
    assert reply.startswith("Invalid guess") and problem in reply and "did not count; 6 guesses left" in reply
    assert env.metrics["guesses"] == 0 and env.metrics["invalid_guesses"] == 1
    assert env.turn_rewards == [0.0] and not env.done


def test_solving_on_the_first_guess_scores_one_and_guesses_are_case_insensitive():
    env = new_game("apple")
    assert env.guess(" APPLE ").splitlines() == ["APPLE -> G G G G G", "Solved in 1 guess!"]
    assert env.done and env.success and env.reward == 1.0 and env.turn_rewards == [1.0]


@pytest.mark.parametrize(("wrong", "reward"), [(2, 0.8), (5, 0.5)])
def test_solving_later_scores_less(wrong, reward):
    env = new_game("apple")
    env.guess("pear")  # invalid: costs nothing
    for word in ["crane", "moist", "lucky", "dough", "brief"][:wrong]:
        env.guess(word)
    assert env.guess("apple").endswith(f"Solved in {wrong + 1} guesses!")
    assert env.success and env.reward == pytest.approx(reward)
    assert env.turn_rewards == [0.0] * (wrong + 1) + [pytest.approx(reward)]
    assert env.metrics["guesses"] == wrong + 1 and env.metrics["best_greens"] == 5


def test_running_out_of_guesses_scores_zero_and_reveals_the_word():
    env = new_game("apple", max_guesses=3)
    env.guess("crane")
    assert env.guess("moist").endswith("1 guess left.")
    assert env.guess("lucky").endswith("Out of guesses. The word was APPLE.")
    assert env.done and env.success is False and env.reward == 0.0
    assert env.guess("apple") == "The game is over; this guess was not played."
    assert env.reward == 0.0 and env.metrics["guesses"] == 3 and env.turn_rewards == [0.0] * 4


def test_a_secret_outside_the_list_can_be_guessed_but_must_have_five_letters():
    env = new_game("Qwxyz")
    assert env.guess("qwxyz").endswith("Solved in 1 guess!")
    with pytest.raises(ValueError, match="5-letter word"):
        new_game("pear")


def test_the_word_list_ships_in_the_package():
    text = resources.files("trajlab.env.builtin").joinpath("data/wordle_words.txt").read_text()
    words = text.splitlines()
    assert tuple(words) == WORDS and len(words) >= 1000
    assert words == sorted(set(words))
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in words)


def test_the_guess_tool_has_a_schema():
    assert SPEC.name == "wordle"
    [tool] = SPEC.tools
    assert tool["function"]["name"] == "guess"
    assert tool["function"]["parameters"]["required"] == ["word"]


def test_splits_are_disjoint_cover_the_word_list_and_are_seeded():
    train = [t["task_id"] for t in SPEC.iter_tasks("train", seed=0)]
    test = [t["task_id"] for t in SPEC.iter_tasks("test", seed=1)]
    assert test and not set(train) & set(test)
    assert sorted(train + test) == sorted(f"wordle-{w}" for w in WORDS)
    assert [t["task_id"] for t in SPEC.iter_tasks("test", seed=0)] != test
    assert [t["task_id"] for t in SPEC.iter_tasks("test", seed=1)] == test
    task = next(SPEC.iter_tasks("test", seed=0))
    assert task == {"task_id": f"wordle-{task['secret']}", "secret": task["secret"], "max_guesses": 6}


def test_oracle_solves_the_test_split_through_the_tools(tiny_tokenizer, tiny_template):
    tasks = list(SPEC.iter_tasks("test", seed=0))
    results = run_oracle(SPEC, tasks, tiny_tokenizer, tiny_template)
    assert len(results) == len(tasks)
    assert all(t.metrics["tool_errors"] == 0 and t.metrics["parse_errors"] == 0 for t in results)
    assert all(t.metrics["env/invalid_guesses"] == 0 for t in results)
    solved = [t for t in results if t.status == "success"]
    rate = len(solved) / len(results)
    mean_guesses = statistics.mean(t.metrics["env/guesses"] for t in solved)
    print(f"wordle oracle: solved {rate:.3f} of {len(results)} test tasks, {mean_guesses:.2f} guesses on average")
    assert rate >= 0.9, [(t.id, t.status, t.stop_reason) for t in results if t.status != "success"]
    assert all(t.reward == pytest.approx(1.0 - 0.1 * (t.metrics["env/guesses"] - 1)) for t in solved)
