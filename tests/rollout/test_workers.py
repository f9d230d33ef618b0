"""Rollout workers on a real local Ray cluster (two CPUs, its temp dir inside the test's run directory)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal

import pytest

from trajlab.chat.parsers import get_parser
from trajlab.env import load_env
from trajlab.inference.base import SamplingParams
from trajlab.inference.policy import load_policy
from trajlab.rollout.engine import Episode, make_engine
from trajlab.rollout.workers import RayRolloutRunner, WorkerSpec

pytest.importorskip("ray")
SAMPLING = SamplingParams(temperature=1.0)
LIMITS = {"max_turns": 2, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def episodes():
    tasks = list(itertools.islice(load_env("arithmetic").iter_tasks("test"), 8))
    return [Episode(f"e{i}:{t['task_id']}", t, split="test") for i, t in enumerate(tasks)]


@pytest.fixture(scope="module")
def in_process(tiny_model_dir, episodes):
    """The same episodes on the in-process engine: what the workers must reproduce, token for token."""
    policy = load_policy(str(tiny_model_dir), device="cpu")
    with make_engine(load_env("arithmetic"), policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                     parser=get_parser("auto", policy.tokenizer), sampling=SAMPLING, limits=LIMITS, seed=3) as engine:
        return {t.id: t for t in asyncio.run(engine.run(episodes))}


@pytest.fixture(scope="module")
def runner(tiny_model_dir, tmp_path_factory):
    spec = WorkerSpec(env=load_env("arithmetic"), policy=str(tiny_model_dir), device="cpu", sampling=SAMPLING,
                      limits=LIMITS, seed=3)
    run_dir = tmp_path_factory.mktemp("run")
    runner = RayRolloutRunner(spec, workers=2, run_dir=run_dir)
    yield runner
    runner.close()
    assert (run_dir / "ray").is_dir(), "the local cluster's files are reachable from the run directory"


def same_episode(remote, local) -> None:
    assert remote.model_dump(exclude={"metrics", "tokens"}) == local.model_dump(exclude={"metrics", "tokens"})
    assert remote.tokens.prompt_ids == local.tokens.prompt_ids
    assert remote.tokens.completion_ids == local.tokens.completion_ids
    assert remote.tokens.loss_mask == local.tokens.loss_mask
    pairs = [(a, b) for a, b in zip(remote.tokens.logprobs, local.tokens.logprobs, strict=True) if a is not None]
    assert all(abs(a - b) < 1e-4 for a, b in pairs) and pairs


def test_workers_give_the_in_process_trajectories_token_for_token(runner, episodes, in_process):
    streamed = []
    trajectories = asyncio.run(runner.run(episodes, concurrency=8, on_result=streamed.append))
    assert sorted(t.id for t in streamed) == sorted(t.id for t in trajectories) == sorted(in_process)
    for trajectory in trajectories:
        same_episode(trajectory, in_process[trajectory.id])
    counters = runner._ray.get([worker.counters.remote() for worker in runner.workers])
    assert all(c["batches"] > 0 for c in counters), "both workers generated"


def kill_the_busiest_worker(runner):
    """An ``on_result`` hook: at the first result (seven episodes still in flight) SIGKILL the worker with the most."""
    pids, killed = runner.pids(), []

    def hook(_trajectory) -> None:
        if not killed:
            busiest = max(range(len(pids)), key=runner._load.__getitem__)
            assert runner._load[busiest] > 0
            os.kill(pids[busiest], signal.SIGKILL)
            killed.append((busiest, pids[busiest]))

    return hook, killed


def test_a_worker_killed_mid_run_loses_and_duplicates_nothing(runner, episodes, in_process):
    hook, killed = kill_the_busiest_worker(runner)
    kept = asyncio.run(runner.run(episodes, concurrency=8, on_result=hook, retries=0))
    assert sorted(t.id for t in kept) == sorted(in_process), "each episode exactly once"
    lost = [t for t in kept if t.status == "error"]
    assert lost and all(t.error.startswith(f"rollout worker {killed[0][0]} died") for t in lost)
    assert runner.replaced == 1 and runner.pids()[killed[0][0]] != killed[0][1], "the dead worker was replaced"

    hook, killed = kill_the_busiest_worker(runner)
    retried = asyncio.run(runner.run(episodes, concurrency=8, on_result=hook, retries=2, retry_backoff_s=0.1))
    assert sorted(t.id for t in retried) == sorted(in_process)
    assert runner.replaced == 2 and any(t.metrics.get("attempts") for t in retried)
    for trajectory in retried:  # run again elsewhere, an episode samples what it would have the first time
        assert trajectory.status != "error"
        same_episode(trajectory, in_process[trajectory.id])
