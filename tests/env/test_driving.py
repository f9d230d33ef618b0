import itertools
import json
import math

import pytest

from tests.env.oracle import run_oracle
from trajlab.env.base import tool_call_message, tool_schemas
from trajlab.env.builtin.driving import (
    BRAKE_MS2,
    LANE_CHANGE_S,
    MAX_TOOL_CALLS,
    SAFE_GAP_M,
    SPEC,
    STEP_S,
    Driving,
    oracle,
)


def road(speed: float, distance: float, lane: int = 1, lanes: int = 2, **others: tuple[str, float]) -> dict:
    """A task: a pedestrian ``distance`` m ahead in the car's lane, plus ``lane<N>=(kind, distance)`` hazards."""
    hazards = [{"kind": "pedestrian", "lane": lane, "distance": distance}]
    hazards += [{"kind": kind, "lane": int(name[4:]), "distance": at} for name, (kind, at) in others.items()]
    return {"task_id": "t", "lanes": lanes, "lane": lane, "speed": speed, "hazards": hazards}


def started(task: dict) -> Driving:
    env = Driving()
    env.reset(**task)
    return env


def stopping_distance(speed: float, decision_steps: int) -> float:
    return speed * STEP_S * decision_steps + speed**2 / (2 * BRAKE_MS2)


def test_tools_have_schemas_and_tasks_are_json():
    assert {t["function"]["name"] for t in tool_schemas(Driving)} == {"observe", "emergency_stop", "lane_change"}
    assert SPEC.name == "driving"
    task = next(SPEC.iter_tasks("train", seed=0))
    assert json.loads(json.dumps(task)) == task
    assert "Use observe to see the road." in Driving().reset(**task)


def test_stopping_distance_is_decision_steps_plus_braking_distance():
    env = started(road(speed=20, distance=100))
    env.observe()
    reply = env.emergency_stop()
    gap = 100 - stopping_distance(20, decision_steps=2)  # 100 - 20 - 400/14 = 51.43 m
    assert env.position == pytest.approx(100 - gap)
    assert env.metrics["min_gap_m"] == pytest.approx(gap) and env.metrics["stopped"] == 1
    assert f"You stopped {gap:.1f} m before the pedestrian" in reply
    assert env.done and env.success and env.reward == 1.0


@pytest.mark.parametrize("slack", [0.5, -0.5])
def test_a_stop_short_of_the_pedestrian_is_safe_and_one_past_it_a_collision(slack):
    env = started(road(speed=25, distance=stopping_distance(25, decision_steps=1) + slack))
    reply = env.emergency_stop()
    assert env.done and env.success is (slack > 0)
    if slack > 0:
        assert env.reward == pytest.approx(0.5 + 0.5 * slack / SAFE_GAP_M)
    else:
        # Braking from 25 m/s, it reaches the pedestrian 0.5 m before it would have stopped: v^2 = 2 a 0.5.
        assert env.reward == 0.0 and env.metrics["collision"] == 1
        assert f"at {math.sqrt(2 * BRAKE_MS2 * 0.5):.1f} m/s" in reply


def test_dithering_costs_distance():
    env = started(road(speed=20, distance=80))
    first = env.observe()
    second = env.observe()
    assert "time to collision 3.5 s" in first and "pedestrian 70.0 m ahead" in first
    assert "pedestrian 60.0 m ahead" in second and env.time == 2 * STEP_S


def test_invalid_direction_is_an_error_that_only_costs_time():
    env = started(road(speed=20, distance=80, lane=1, lanes=3))
    reply = env.lane_change("up")
    assert reply.startswith("Error: direction must be 'left' or 'right', got 'up'")
    assert env.lane == 1 and env.position == 20 * STEP_S and not env.done


def test_driving_off_the_road_is_an_error():
    env = started(road(speed=20, distance=80, lane=1, lanes=2))
    assert env.lane_change("left").startswith("Error: there is no lane to the left of lane 1")
    env = started(road(speed=20, distance=80, lane=2, lanes=2))
    assert env.lane_change("Right").startswith("Error: there is no lane to the right of lane 2")
    assert env.lane == 2 and env.metrics["lane_changes"] == 0 and not env.done


def test_a_lane_change_into_a_clear_lane_drives_past():
    env = started(road(speed=30, distance=60, lane=2, lanes=3, lane1=("parked car", 20)))
    reply = env.lane_change("right")
    gap = 60 - 30 * (STEP_S + LANE_CHANGE_S)  # braking now would need 15 + 900/14 = 79 m
    assert "drove safely past" in reply
    assert env.success and env.lane == 3 and env.metrics["min_gap_m"] == pytest.approx(gap)


def test_a_lane_change_straddles_both_lanes():
    env = started(road(speed=30, distance=60, lane=2, lanes=3, lane1=("parked car", 20)))
    assert env.lane_change("left") == "Collision: you hit the parked car in lane 1 at 30.0 m/s."
    assert env.reward == 0.0 and env.success is False
    env = started(road(speed=30, distance=30, lane=1))
    assert "hit the pedestrian in lane 1" in env.lane_change("right")  # too late: it reaches her mid-manoeuvre


def test_a_lane_change_into_a_lane_with_something_ahead_goes_on():
    env = started(road(speed=16, distance=40, lane=1, lane2=("pedestrian", 100)))
    reply = env.lane_change("right")
    assert reply.startswith("You moved to lane 2.") and "Lane 2 (your lane): pedestrian 80.0 m ahead" in reply
    assert not env.done and env.lane == 2
    assert env.emergency_stop().startswith("You stopped") and env.success


def test_the_car_drives_on_after_the_last_tool_call():
    env = started(road(speed=16, distance=300))
    replies = [env.observe() for _ in range(MAX_TOOL_CALLS)]
    assert not any("Collision" in reply for reply in replies[:-1])
    assert "last of 6 tool calls" in replies[-1] and "Collision: you hit the pedestrian" in replies[-1]
    assert env.done and env.reward == 0.0 and env.metrics["tool_calls"] == MAX_TOOL_CALLS


def test_reward_orders_collision_below_a_small_margin_below_a_large_one():
    rewards = []
    for slack in (-1.0, 1.0, 4.0, 20.0):
        env = started(road(speed=20, distance=stopping_distance(20, decision_steps=1) + slack))
        env.emergency_stop()
        rewards.append(env.reward)
    assert rewards[0] == 0.0 < rewards[1] < rewards[2] < rewards[3] == 1.0


def test_splits_are_disjoint_and_seeded():
    train = [t["task_id"] for t in SPEC.iter_tasks("train", seed=0)]
    test = [t["task_id"] for t in SPEC.iter_tasks("test", seed=1)]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert train and test and not set(train) & set(test)
    again = [t["task_id"] for t in itertools.islice(SPEC.iter_tasks("train", seed=0), 20)]
    assert again == train[:20]
    assert [t["task_id"] for t in itertools.islice(SPEC.iter_tasks("train", seed=5), 20)] != again


def play(policy, task: dict) -> Driving:
    """Run a policy straight on the env, feeding it the conversation as the engine builds it."""
    env = Driving()
    messages = [{"role": "user", "content": env.reset(**task)}]
    while not env.done:
        message = policy(task, messages)
        call = message["tool_calls"][0]["function"]
        messages += [message, {"role": "tool", "content": getattr(env, call["name"])(**call["arguments"])}]
    return env


def observe_then(name: str, arguments: dict):
    """A naive policy: observe once, then always make the same call whatever it saw."""
    def policy(task, messages):
        seen = any(m["role"] == "tool" for m in messages)
        return tool_call_message(name, arguments) if seen else tool_call_message("observe", {})
    return policy


NAIVE = {
    "observe, then brake": observe_then("emergency_stop", {}),
    "observe, then left": observe_then("lane_change", {"direction": "left"}),
    "observe, then right": observe_then("lane_change", {"direction": "right"}),
    "brake at once": lambda task, messages: tool_call_message("emergency_stop", {}),
    "left at once": lambda task, messages: tool_call_message("lane_change", {"direction": "left"}),
}


def test_the_oracle_solves_every_test_task_from_the_observations_alone():
    tasks = list(SPEC.iter_tasks("test", seed=0))
    # An empty task dict: the oracle decides from the observation text in the messages only.
    envs = [play(lambda task, messages: oracle({}, messages), task) for task in tasks]
    assert all(env.success for env in envs)
    assert all(env.metrics["tool_calls"] == 2 and env.metrics["min_gap_m"] >= 1.0 for env in envs)


@pytest.mark.parametrize("name", NAIVE)
def test_policies_that_ignore_the_observation_fail_a_clear_share(name):
    tasks = list(SPEC.iter_tasks("test", seed=0))
    success = sum(play(NAIVE[name], task).success for task in tasks) / len(tasks)
    assert 0.2 < success < 0.75, success


def test_oracle_succeeds_on_every_test_task_through_the_rollout_engine(tiny_tokenizer, tiny_template):
    tasks = list(SPEC.iter_tasks("test", seed=0))
    results = run_oracle(SPEC, tasks, tiny_tokenizer, tiny_template, concurrency=32)
    assert len(results) == len(tasks)
    assert all(t.status == "success" for t in results), [(t.id, t.status, t.messages[-1]) for t in results]
    assert all(t.metrics["tool_errors"] == 0 and t.metrics["parse_errors"] == 0 for t in results)
    assert {t.messages[2]["tool_calls"][0]["function"]["name"] for t in results} == {"observe"}
    assert {t.messages[4]["tool_calls"][0]["function"]["name"] for t in results} == {"emergency_stop", "lane_change"}
