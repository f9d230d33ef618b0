"""The LLM judge against a scripted judge served over real HTTP (a FAKE for a judge LLM, tests/rewards/conftest.py)
and against `trajlab serve` (its own process) on the real tiny model (which answers garbage): the prompt, the score
format, retries, timeouts, the cache, the concurrency limit, the usage, and a judge that is down being an
infrastructure error of the trajectory."""

import asyncio
import json
import socket

import pytest

from tests.proxy.test_server import free_port, serving
from trajlab.errors import UserError
from trajlab.rewards import JudgeError, LLMJudge, RewardSet, parse_attempt_scores, parse_score, render_conversation
from trajlab.rollout.types import Trajectory

JUDGE = "trajlab.rewards.judge:LLMJudge"


def episode(i: int, answer: str = "42") -> Trajectory:
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 6*7?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}]},
                {"role": "tool", "name": "multiply", "content": "42"},
                {"role": "assistant", "content": f"The answer is {answer}."}]
    return Trajectory(id=f"e{i}", env="arithmetic", task={"id": i, "question": "6*7"}, messages=messages, tools=[],
                      reward=1.0, status="success", metrics={"turns": 2.0})


def grades_answer(messages: list[dict]) -> str:
    return "Correct.\nSCORE: 1" if "The answer is 42." in messages[-1]["content"] else "Wrong.\nSCORE: 0.0"


@pytest.mark.parametrize(("text", "score"), [("fine\nSCORE: 0.75", 0.75), ("**Score:** 1", 1.0),
                                             ("score = 0\n", 0.0), ("SCORE: 0.2\nthinking again\nSCORE: 0.9", 0.9)])
def test_the_score_is_the_last_score_line(text, score):
    assert parse_score(text) == score


@pytest.mark.parametrize(("text", "message"), [("I'd say 0.8", "no 'SCORE: <0..1>' line"), ("", "no 'SCORE"),
                                               ("SCORE: 7", "outside 0..1"), ("SCORE: high", "no 'SCORE")])
def test_garbage_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_score(text)


def test_the_conversation_is_rendered_readably():
    text = render_conversation(episode(0))
    assert '[assistant]\n-> calls multiply({"a": 6, "b": 7})' in text
    assert "[tool multiply]\n42" in text and text.startswith("[system]\nUse the calculator.")


def test_scores_each_trajectory_and_logs_its_usage(scripted_judge):
    scripted_judge.reply = grades_answer
    rewards = RewardSet({"env": 0.0, "judge": {"function": JUDGE, "args": {"url": scripted_judge.url,
                                                                           "rubric": "Is 6*7 answered right?"}}})
    batch = [episode(0), episode(1, answer="41")]
    assert rewards.score(batch).totals == [1.0, 0.0]
    assert [t.metrics["reward/judge"] for t in batch] == [1.0, 0.0]
    assert batch[0].metrics["judge/prompt_tokens"] == 100 and batch[0].metrics["judge/completion_tokens"] == 7
    request = scripted_judge.requests[0]
    assert request["model"] == "scripted-judge", "no model in the url: the first the server lists"
    prompt = request["messages"][-1]["content"]
    assert "Is 6*7 answered right?" in prompt and '"question": "6*7"' in prompt and "[tool multiply]" in prompt
    assert "SCORE: <number from 0 to 1>" in request["messages"][0]["content"]


def test_the_same_trajectory_is_graded_once_and_a_cache_file_outlives_the_judge(scripted_judge, tmp_path):
    cache = tmp_path / "judge_cache.jsonl"
    judge = {"function": JUDGE, "args": {"url": scripted_judge.url + "#scripted-judge", "cache": str(cache)}}
    rewards = RewardSet({"judge": judge})
    rewards.score([episode(0)])
    again = episode(0)
    rewards.score([again])
    assert len(scripted_judge.requests) == 1 and again.metrics["judge/cache_hits"] == 1
    assert again.metrics["reward/judge"] == 1.0
    fresh = episode(0)
    RewardSet({"judge": judge}).score([fresh])  # a new run reading the same cache file
    assert len(scripted_judge.requests) == 1 and fresh.metrics["judge/calls"] == 0
    assert [json.loads(line)["score"] for line in cache.read_text().splitlines()] == [1.0]


def test_garbage_is_asked_again_and_still_garbage_is_an_error_of_the_trajectory(scripted_judge):
    answers = iter(["hmm", "SCORE: 0.5"])
    scripted_judge.reply = lambda messages: next(answers)
    args = {"url": scripted_judge.url, "max_retries": 2, "backoff_s": 0.0}
    first = episode(0)
    RewardSet({"judge": {"function": JUDGE, "args": args}}).score([first])
    assert first.metrics["reward/judge"] == 0.5 and first.metrics["judge/calls"] == 2
    scripted_judge.reply = lambda messages: "I cannot grade this."
    broken = episode(1)
    RewardSet({"env": 1.0, "judge": {"function": JUDGE, "args": args}}).score([broken])
    assert broken.status == "error" and broken.metrics["judge/calls"] == 3
    assert "gave no score after 3 tries: the judge's answer has no 'SCORE: <0..1>' line" in broken.error


def test_a_judge_that_is_down_or_too_slow_is_an_infrastructure_error(scripted_judge):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}/v1#judge"
    batch = [episode(0)]
    RewardSet({"judge": {"function": JUDGE, "args": {"url": down, "max_retries": 1, "backoff_s": 0}}}).score(batch)
    assert batch[0].status == "error" and "APIConnectionError" in batch[0].error
    scripted_judge.delay_s = 1.0
    slow = [episode(1)]
    args = {"url": scripted_judge.url, "timeout_s": 0.2, "max_retries": 0}
    RewardSet({"judge": {"function": JUDGE, "args": args}}).score(slow)
    assert slow[0].status == "error" and "APITimeoutError" in slow[0].error


def test_at_most_concurrency_requests_are_in_flight(scripted_judge):
    scripted_judge.delay_s = 0.2
    batch = [episode(i, answer=str(i)) for i in range(6)]  # six different contents: six requests
    RewardSet({"judge": {"function": JUDGE, "args": {"url": scripted_judge.url, "max_concurrency": 2}}}).score(batch)
    assert len(scripted_judge.requests) == 6 and scripted_judge.most_in_flight == 2


def test_a_direct_call_raises_judge_error(scripted_judge):
    scripted_judge.reply = lambda messages: "no idea"
    judge = LLMJudge(scripted_judge.url, max_retries=0)

    async def grade_once() -> float:
        try:
            return await judge(episode(0), {})
        finally:
            await judge.aclose()

    with pytest.raises(JudgeError, match="gave no score after 1 tries"):
        asyncio.run(grade_once())


def test_against_trajlab_serve_on_the_tiny_model(tiny_model_dir, tmp_path):
    """`trajlab serve` in its own process; the tiny model answers garbage: every try is made, its tokens counted,
    and the trajectory masked."""
    batch = [episode(0), episode(1, answer="41")]
    port = free_port()
    with serving("--model", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny-judge",
                 "--record-dir", str(tmp_path / "sessions"), port=port) as url:
        args = {"url": f"{url}/v1#tiny-judge", "max_retries": 1, "backoff_s": 0, "max_tokens": 8}
        RewardSet({"env": 1.0, "judge": {"function": JUDGE, "args": args}}).score(batch)
    for trajectory in batch:
        assert trajectory.status == "error" and "gave no score after 2 tries" in trajectory.error
        assert trajectory.metrics["judge/calls"] == 2 and trajectory.metrics["judge/prompt_tokens"] > 100
        assert 0 < trajectory.metrics["judge/completion_tokens"] <= 16


RELATIVE = "trajlab.rewards.judge:RelativeJudge"


def ranks_by_answer(messages: list[dict]) -> str:
    """Scores each attempt of the prompt: 1 for the right answer, 0.2 for a wrong one."""
    attempts = messages[-1]["content"].split("## Attempt ")[1:]
    return "Compared.\n" + "\n".join(f"ATTEMPT {n}: {1 if 'The answer is 42.' in a else 0.2}"
                                     for n, a in enumerate(attempts, 1))


@pytest.mark.parametrize(("text", "message"), [
    ("ATTEMPT 1: 0.5", r"no 'ATTEMPT <n>: <0..1>' line for attempt\(s\) \[2\]"),
    ("ATTEMPT 1: 0.5\nATTEMPT 2: 1\nATTEMPT 3: 0", r"attempt\(s\) \[3\], but there are 2"),
    ("Attempt 1: 2\nAttempt 2: 0", "outside 0..1"),
])
def test_a_relative_answer_scores_every_attempt_or_is_refused(text, message):
    assert parse_attempt_scores("**Attempt 2:** 0.1\nATTEMPT #1 = 0.9", 2) == [0.9, 0.1]
    with pytest.raises(ValueError, match=message):
        parse_attempt_scores(text, 2)


def test_the_relative_judge_ranks_each_group_in_one_call(scripted_judge):
    scripted_judge.reply = ranks_by_answer
    batch = [episode(0), episode(1, answer="41"), episode(2, answer="41"), episode(3)]
    for trajectory, group in zip(batch, ["a", "a", "b", "b"], strict=True):
        trajectory.group = group
    RewardSet({"rank": {"function": RELATIVE, "args": {"url": scripted_judge.url}}}).score(batch)
    assert [t.metrics["reward/rank"] for t in batch] == [1.0, 0.2, 0.2, 1.0]
    assert len(scripted_judge.requests) == 2, "one request per group"
    prompt = scripted_judge.requests[0]["messages"][-1]["content"]
    assert "## Attempt 1\n" in prompt and "## Attempt 2\n" in prompt and "## Attempt 3" not in prompt
    assert [t.metrics["judge/prompt_tokens"] for t in batch] == [50.0] * 4, "a group's usage shared out"


def test_a_relative_answer_missing_an_attempt_fails_its_group(scripted_judge):
    scripted_judge.reply = lambda messages: "ATTEMPT 1: 1"
    batch = [episode(0), episode(1, answer="41")]
    args = {"url": scripted_judge.url, "max_retries": 1, "backoff_s": 0}
    RewardSet({"rank": {"function": RELATIVE, "args": args}}).score(batch)
    assert [t.status for t in batch] == ["error", "error"] and "for attempt(s) [2]" in batch[1].error
    assert sum(t.metrics["judge/calls"] for t in batch) == 2.0


def test_a_judge_that_cannot_be_built_is_a_user_error_naming_the_reward():
    with pytest.raises(UserError, match=r"reward 'judge' \(trajlab.rewards.judge:LLMJudge\) could not be built with "
                                        r"args \{'url': 'localhost:8000/v1'\}: the judge's url is http"):
        RewardSet({"judge": {"function": JUDGE, "args": {"url": "localhost:8000/v1"}}})


def test_twins_in_one_batch_are_graded_once(scripted_judge):
    """Greedy rollouts of one task are often the same conversation: asked once, the twin waits for that answer."""
    scripted_judge.delay_s = 0.2
    batch = [episode(0), episode(0), episode(0)]
    RewardSet({"judge": {"function": JUDGE, "args": {"url": scripted_judge.url}}}).score(batch)
    assert len(scripted_judge.requests) == 1 and [t.metrics["reward/judge"] for t in batch] == [1.0] * 3
    assert sorted(t.metrics["judge/cache_hits"] for t in batch) == [0.0, 1.0, 1.0]
    scripted_judge.reply = lambda messages: "no score"
    failed = [episode(1), episode(1)]
    RewardSet({"judge": {"function": JUDGE, "args": {"url": scripted_judge.url, "max_retries": 0}}}).score(failed)
    assert [t.status for t in failed] == ["error", "error"] and len(scripted_judge.requests) == 2
    assert "gave no score after 1 tries" in failed[1].error
