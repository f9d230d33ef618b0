"""Rollout workers on a real local Ray cluster (two CPUs, its temp dir inside the test's run directory)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trajlab.chat.parsers import get_parser
from trajlab.collection.workers import RayRolloutRunner, WorkerSpec, _move_into_run
from trajlab.config import ModelSettings, RolloutSettings
from trajlab.data.store import read_trajectories
from trajlab.env.prompts import SYSTEM_PROMPT
from trajlab.errors import UserError
from trajlab.evolution.adapter import TrajlabAdapter
from trajlab.inference.base import SamplingParams
from trajlab.inference.policy import load_policy
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.rollout.engine import make_engine
from trajlab.rollout.runner import Episode

from ..rollout.dying_env import ARITHMETIC, arm

pytest.importorskip("ray")
SAMPLING = SamplingParams(temperature=1.0)
LIMITS = {"max_turns": 2, "max_new_tokens": 24}
ROLLOUT = RolloutSettings(**LIMITS, workers=2)


@pytest.fixture(scope="module")
def episodes():
    tasks = list(itertools.islice(ARITHMETIC.iter_tasks("test", 0), 8))
    return [Episode(f"e{i}:{t['task_id']}", t, split="test") for i, t in enumerate(tasks)]


def run_in_process(model_dir, episodes):
    """``episodes`` on the in-process engine over ``model_dir``: what the workers must reproduce, token for token."""
    policy = load_policy(str(model_dir), device="cpu", dtype="auto", backend="hf", max_batch_size=32)
    with make_engine(ARITHMETIC, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                     parser=get_parser("auto", policy.tokenizer), sampling=SAMPLING, limits=LIMITS, seed=3) as engine:
        return {t.id: t for t in asyncio.run(engine.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0))}


@pytest.fixture(scope="module")
def in_process(tiny_model_dir, episodes):
    return run_in_process(tiny_model_dir, episodes)


@pytest.fixture(scope="module")
def marker(tmp_path_factory):
    """While this file exists the workers' episodes run normally; remove it and the next one kills its worker."""
    marker = tmp_path_factory.mktemp("die") / "died"
    marker.touch()
    return marker


@pytest.fixture(scope="module")
def runner(tiny_model_dir, tmp_path_factory, marker):
    spec = WorkerSpec(env=ARITHMETIC, policy=str(tiny_model_dir), tokenizer=None, model=ModelSettings(device="cpu"),
                      rollout=ROLLOUT, temperature=SAMPLING.temperature, seed=3)
    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as monkeypatch:
        arm(monkeypatch, marker)  # before the cluster starts: its workers inherit the environment
        runner = RayRolloutRunner(spec, run_dir=run_dir)
        yield runner
        runner.close()
    ray_dir = run_dir / "ray"
    assert ray_dir.is_dir() and not ray_dir.is_symlink(), "the closed cluster's files moved into the run directory"
    assert any(ray_dir.rglob("*.log")), "its logs are there"


def same_episode(remote, local) -> None:
    assert remote.model_dump(exclude={"metrics", "tokens"}) == local.model_dump(exclude={"metrics", "tokens"})
    assert remote.tokens.prompt_ids == local.tokens.prompt_ids
    assert remote.tokens.completion_ids == local.tokens.completion_ids
    assert remote.tokens.loss_mask == local.tokens.loss_mask
    gaps = [abs(a - b) for a, b in zip(remote.tokens.logprobs, local.tokens.logprobs, strict=True) if a is not None]
    wide = [i for i, gap in enumerate(gaps) if gap >= 1e-4]
    assert gaps and not wide, f"{remote.id}: logprob gaps up to {max(gaps, default=0):.3g} at {wide} of {len(gaps)}"


def test_workers_give_the_in_process_trajectories_token_for_token(runner, episodes, in_process):
    streamed = []
    trajectories = asyncio.run(runner.run(episodes, concurrency=8, on_result=streamed.append, retries=0,
                                          retry_backoff_s=1.0))
    assert sorted(t.id for t in streamed) == sorted(t.id for t in trajectories) == sorted(in_process)
    for trajectory in trajectories:
        same_episode(trajectory, in_process[trajectory.id])
    counters = runner._ray.get([worker.counters.remote() for worker in runner.workers])
    assert all(c["batches"] > 0 for c in counters), "both workers generated"


def test_a_worker_killed_mid_run_loses_and_duplicates_nothing(runner, marker, episodes, in_process):
    pids = runner.pids()
    marker.unlink()  # an episode's reset now SIGKILLs its worker, with the others it holds in flight
    kept = asyncio.run(runner.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0))
    assert marker.exists(), "a worker was killed"
    assert sorted(t.id for t in kept) == sorted(in_process), "each episode exactly once"
    lost = [t for t in kept if t.status == "error"]
    dead = {int(t.error.split()[2]) for t in lost}
    assert lost and len(dead) == 1 and all(t.error.startswith(f"rollout worker {min(dead)} died") for t in lost)
    for trajectory in kept:
        if trajectory.status != "error":
            same_episode(trajectory, in_process[trajectory.id])
    assert runner.replaced == 1 and runner.pids()[min(dead)] != pids[min(dead)], "the dead worker was replaced"

    marker.unlink()
    retried = asyncio.run(runner.run(episodes, concurrency=8, retries=2, retry_backoff_s=0.1))
    assert marker.exists(), "a worker was killed"
    assert sorted(t.id for t in retried) == sorted(in_process)
    assert runner.replaced == 2 and any(t.metrics.get("attempts") for t in retried)
    for trajectory in retried:  # run again elsewhere, an episode samples what it would have the first time
        assert trajectory.status != "error"
        same_episode(trajectory, in_process[trajectory.id])


def test_evolve_candidates_reach_every_worker(runner, tiny_model_dir, episodes, tmp_path):
    """Prompt evolution on workers: each candidate's system prompt and tool descriptions are what the workers show
    the model, and the episodes equal the in-process adapter's token for token."""
    candidates = [{SYSTEM_PROMPT: "Compute with the tools, then submit.", "tool:add": "Sum of a and b."},
                  {SYSTEM_PROMPT: "Submit the answer."}]
    batch = [episode.task for episode in episodes[:4]]
    policy = load_policy(str(tiny_model_dir), device="cpu", dtype="auto", backend="hf", max_batch_size=32)
    engine = make_engine(ARITHMETIC, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                         parser=get_parser("auto", policy.tokenizer), sampling=SAMPLING, limits=LIMITS, seed=3)
    runs = {}
    try:
        for name, rollouts in (("local", engine), ("workers", runner)):
            adapter = TrajlabAdapter(rollouts, weights=None, rollout=RolloutSettings(concurrency=8, retries=0))
            with adapter.recording(tmp_path / f"{name}.jsonl"):
                scores = [adapter.evaluate(batch, candidate).scores for candidate in candidates]
            runs[name] = (scores, {t.id: t for t in read_trajectories(tmp_path / f"{name}.jsonl")})
    finally:
        engine.close()
        runner.present(ARITHMETIC.system_prompt or "", {})  # the module's other tests see the env as it is
    assert runs["workers"][0] == runs["local"][0]
    local, remote = runs["local"][1], runs["workers"][1]
    assert sorted(remote) == sorted(local) and len(local) == len(batch) * len(candidates)
    for trajectory in remote.values():
        same_episode(trajectory, local[trajectory.id])
    shown = {t.messages[0]["content"] for t in remote.values()}
    assert shown == {candidate[SYSTEM_PROMPT] for candidate in candidates}
    described = {tool["function"]["description"] for t in remote.values() for tool in t.tools
                 if tool["function"]["name"] == "add"}
    assert "Sum of a and b." in described and len(described) == 2, "each candidate's own tool descriptions"


def test_weights_reach_every_worker_in_one_broadcast_and_a_replacement_gets_them(runner, marker, episodes,
                                                                                 tiny_model_dir, tmp_path):
    """Trained weights go to both workers in one broadcast (each byte sent once), not through Ray's object store;
    a worker killed after the sync is replaced by one that gets the same weights before its first episode."""
    model = load_model(tiny_model_dir)
    with torch.no_grad():  # the trained weights: moved far enough to change what is sampled
        generator = torch.Generator().manual_seed(0)
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(tmp_path / "trained")
    load_tokenizer(tiny_model_dir).save_pretrained(tmp_path / "trained")
    expected = {key: trajectory.model_copy(update={"policy": str(tiny_model_dir)})  # the workers' policy name
                for key, trajectory in run_in_process(tmp_path / "trained", episodes).items()}
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    sent = runner.sent_bytes
    try:
        runner.load_weights(model)
        assert runner.sent_bytes - sent == size, "one broadcast for both workers"
        for trajectory in asyncio.run(runner.run(episodes, concurrency=8, retries=0, retry_backoff_s=1.0)):
            same_episode(trajectory, expected[trajectory.id])
        replaced = runner.replaced
        marker.unlink()
        retried = asyncio.run(runner.run(episodes, concurrency=8, retries=2, retry_backoff_s=0.1))
        assert marker.exists() and runner.replaced == replaced + 1, "a worker was killed and replaced"
        for trajectory in retried:  # wherever it ran, the replacement included, from the trained weights
            assert trajectory.status != "error"
            same_episode(trajectory, expected[trajectory.id])
        deadline = time.monotonic() + 60  # its transfer runs in a thread of its own; its episodes waited for it
        while runner.sent_bytes - sent < 2 * size and time.monotonic() < deadline:
            time.sleep(0.1)
        assert runner.sent_bytes - sent == 2 * size, "the replacement got the weights last sent"
    finally:
        runner.load_weights(load_model(tiny_model_dir))  # the module's other tests see the model as it is


def test_workers_asking_for_gpus_the_cluster_lacks_are_refused_at_once(runner):
    with pytest.raises(UserError, match=r"2 workers of 1 GPU need 2 free GPUs, and the Ray cluster has 0"):
        gpus = runner.spec.rollout.model_copy(update={"worker_gpus": 1.0})
        RayRolloutRunner(replace(runner.spec, rollout=gpus), run_dir=None, worker_cpus=0)


def test_a_short_temp_dir_moves_into_the_run_once_the_cluster_is_down(tmp_path):
    """A run directory too deep for unix socket paths gets its cluster files in /tmp, linked as run/ray; closing
    moves them into the run (dead sockets dropped), so nothing is left in /tmp."""
    short = tempfile.mkdtemp(prefix="trajlab-ray-")
    Path(short, "logs").mkdir()
    Path(short, "logs", "raylet.out").write_text("log")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(Path(short, "raylet.sock")))
    link = tmp_path / "run" / "ray"
    link.parent.mkdir()
    link.symlink_to(short, target_is_directory=True)
    _move_into_run(short, link)
    assert not Path(short).exists() and link.is_dir() and not link.is_symlink()
    assert (link / "logs" / "raylet.out").read_text() == "log" and not (link / "raylet.sock").exists()
