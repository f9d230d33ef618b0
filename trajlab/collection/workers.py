"""Rollout workers on Ray: episodes run on N actors, each with its own generator and env instances.

An episode is serialisable in (``Episode``) and out (``Trajectory``), so a worker is the in-process engine moved into
a Ray actor: it builds its policy from a :class:`WorkerSpec` (a model directory, a server URL or ``oracle``; never a
live object) and runs episodes on its own event loop, where its generator batches their turns as the in-process
engine's does. The driver's :class:`RayRolloutRunner` is an ``EpisodeRunner`` like the in-process engines: results
stream back as episodes finish, retries and ``on_result`` work the same, and sampling is seeded per episode and turn,
so where an episode runs does not change what it samples.

A worker that dies takes its episodes in flight with it: each comes back as an ``error`` trajectory naming the
worker (the runner's retries run it again elsewhere), and the dead worker is replaced by a fresh one that gets the
latest weights. After an optimizer step, :meth:`RayRolloutRunner.load_weights` broadcasts the trainer's weights to
every worker at once in packed buckets over a gloo process group of their own
(:mod:`trajlab.inference.weight_broadcast`; each byte leaves the trainer once, whatever the number of workers), not
through Ray's object store. The trainer keeps a host copy of the weights it last sent, from which a replacement
worker gets them before its first episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trajlab.config import ModelSettings, RolloutSettings
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.errors import UserError, require
from trajlab.inference import weight_broadcast
from trajlab.rollout.runner import Episode, EpisodeRunner
from trajlab.rollout.types import Trajectory

logger = logging.getLogger(__name__)
INSTALL = "pip install 'trajlab[ray]'"
MAX_SOCKET_DIR = 40
"""Ray puts unix sockets under ``<temp dir>/session_<date>_<pid>/sockets/`` and the kernel caps their paths at 107
bytes: a longer run directory gets a short temp dir elsewhere, linked from the run directory."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds its engine from: picklable names and the validated settings (no loaded model, tokenizer
    or generator)."""

    env: EnvSpec | EnvMixture
    policy: str
    """``oracle``, a model directory or a server URL (see ``trajlab.inference.policy.load_policy``)."""
    tokenizer: str | None
    model: ModelSettings
    """Where a model-directory policy is loaded and on which backend."""
    rollout: RolloutSettings
    """Parser, prompts, limits; ``concurrency`` is each worker's batch size and episodes at once."""
    temperature: float
    seed: int
    stages: tuple[tuple[EnvSpec | EnvMixture, dict[str, int | float]], ...] = ()
    """A curriculum's stages, each its env (prompts resolved) and limit overrides; none: ``env`` is the only one."""


class RolloutWorker:
    """The body of one Ray actor: an in-process engine over the worker's own policy."""

    def __init__(self, spec: WorkerSpec, held: bool = False) -> None:
        """``held``: a replacement, whose episodes wait until :meth:`take_over` gave it what the others have."""
        from trajlab.collection.engines import load_rollout_policy, rollout_engine

        policy = load_rollout_policy(spec.env, spec.policy, model=spec.model, rollout=spec.rollout,
                                     tokenizer=spec.tokenizer, demonstrator=None)
        self.generator = policy.generator
        self.engine = rollout_engine(spec.env, policy, rollout=spec.rollout, temperature=spec.temperature,
                                     seed=spec.seed)
        self._base = self.engine
        self._stages = [rollout_engine(env, policy, rollout=spec.rollout, temperature=spec.temperature,
                                       seed=spec.seed, limits=limits) for env, limits in spec.stages]
        self._group: Any = None
        self._ready = threading.Event()
        if not held:
            self._ready.set()

    async def run_episode(self, episode: Episode, stage: int | None = None) -> Trajectory:
        """Roll out ``episode`` on the worker's engine, or on a curriculum stage's (a held replacement's first
        episodes wait for its :meth:`take_over`: Ray may run an async actor's calls out of order)."""
        if not self._ready.is_set():
            await asyncio.to_thread(self._ready.wait)
        return await (self.engine if stage is None else self._stages[stage]).run_episode(episode)

    def take_over(self, rendezvous: tuple[str, int] | None, description: dict[str, list],
                  presented: tuple[str, dict[str, str]] | None) -> None:
        """A replacement's setup in one call, then its episodes may run: the weights last sent (over a group of its
        own with the trainer serving ``rendezvous``) and the prompt shown (``presented``)."""
        if rendezvous is not None:
            self.join_weight_group(*rendezvous, 1, 2)
            self.receive_weights(description)
        if presented is not None:
            self.present(*presented)
        self._ready.set()

    def present(self, system_prompt: str, tool_descriptions: dict[str, str]) -> None:
        """Show the model this system prompt and these tool descriptions from the next episode on (a prompt
        evolution candidate); the tools themselves do not change."""
        self.engine = self._base.with_tool_descriptions(tool_descriptions)
        self.engine.system_prompt = system_prompt

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take the trainer's weights (base-checkpoint names, LoRA merged): the next turns sample from them."""
        model = getattr(self.generator, "model", None)
        if isinstance(model, torch.nn.Module):  # hf: copied in place, which also drops its kept key/value states
            model.load_state_dict(weights)
        elif hasattr(self.generator, "load_named_weights"):  # vllm
            self.generator.load_named_weights(weights)
        else:
            raise TypeError(f"the {type(self.generator).__name__} policy of this worker takes no weights: RL with "
                            "rollout workers needs a model directory (hf or vllm backend)")

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Join the trainer's weight transfer group (in place of any earlier one); returns once every rank has."""
        self._group = weight_broadcast.open_group(host, port, rank, world_size)

    def receive_weights(self, description: dict[str, list]) -> None:
        """Receive the weights the trainer broadcasts (``description`` says what they are) and take them."""
        weights: dict[str, torch.Tensor] = {}
        weight_broadcast.receive(self._group, description, weights.update)
        self.load_weights(weights)

    def counters(self) -> dict[str, int]:
        """The generator's work so far (``batches``: generate calls), for the driver's step metrics."""
        return {"batches": int(getattr(self.generator, "batches", 0))}

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        for engine in (self._base, *self._stages):  # engines made by with_env share their threads
            engine.close()


class RayRolloutRunner(EpisodeRunner):
    """Runs episodes on ``spec.rollout.workers`` Ray actors; see the module doc.

    Where: ``spec.rollout.ray_address`` ``local`` starts a Ray cluster in this process (its temp dir under
    ``run_dir``, ``run_dir/ray``), ``auto`` joins the one this machine runs (``ray start``), anything else is a
    cluster address. Each actor gets ``worker_cpus`` CPUs and ``spec.rollout.worker_gpus`` GPUs (Ray sets its
    ``CUDA_VISIBLE_DEVICES``) and runs ``spec.rollout.concurrency`` episodes at once.
    """

    def __init__(self, spec: WorkerSpec, *, run_dir: str | Path | None, worker_cpus: float = 1.0) -> None:
        workers, worker_gpus = spec.rollout.workers, spec.rollout.worker_gpus
        if workers < 1:
            raise UserError(f"rollout.workers must be at least 1 to use Ray (got {workers}); 0 runs in-process.")
        self._ray = require("ray", feature="rollout.workers", install=INSTALL)
        self.spec = spec
        self._started_ray = False
        self._own_temp_dir: str | None = None  # made for a cluster with no run_dir; deleted with the cluster
        self._linked_temp_dir: tuple[str, Path] | None = None  # a short dir and its link in run_dir; moved there
        if not self._ray.is_initialized():
            self._start_ray(spec.rollout.ray_address, run_dir, workers * worker_cpus)
        free = self._ray.available_resources()
        for resource, each in (("CPU", worker_cpus), ("GPU", worker_gpus)):
            if each and free.get(resource, 0.0) < workers * each:  # Ray would wait forever to place them
                raise UserError(f"rollout.workers: {workers} workers of {each:g} {resource} need {workers * each:g} "
                                f"free {resource}s, and the Ray cluster has {free.get(resource, 0.0):g} (others may be "
                                "held by running actors): use fewer workers"
                                f"{', or rollout.worker_gpus below 1 to share a GPU' if resource == 'GPU' else ''}, "
                                "or a bigger cluster.")
        self._actor = self._ray.remote(RolloutWorker).options(num_cpus=worker_cpus, num_gpus=worker_gpus,
                                                              max_concurrency=spec.rollout.concurrency + 4)
        self._weights: dict[str, torch.Tensor] | None = None  # a host copy of the latest weights sent, for replacements
        self._description: dict[str, list] = {}
        self._group: Any = None
        self._group_workers: list[Any] = []  # the workers in the transfer group, trainer at rank 0
        self.sent_bytes = 0
        """Bytes of weights the trainer broadcast so far (once per sync, whatever the number of workers)."""
        self._presented: tuple[str, dict[str, str]] | None = None  # the latest present(), likewise
        self.workers = [self._actor.remote(spec) for _ in range(workers)]
        self._load = [0] * workers  # episodes in flight per worker
        self.replaced = 0
        """Workers that died and were replaced."""
        self._ray.get([worker.pid.remote() for worker in self.workers])  # built, or the error is raised here

    @property
    def batches(self) -> int:
        """Generate calls of every live worker so far."""
        return sum(c["batches"] for c in self._ray.get([w.counters.remote() for w in self.workers]))

    async def run_episode(self, episode: Episode, stage: int | None = None) -> Trajectory:
        """Run ``episode`` on the least loaded worker (on a curriculum ``stage``'s engine when given)."""
        index = min(range(len(self.workers)), key=self._load.__getitem__)
        worker = self.workers[index]
        self._load[index] += 1
        try:
            return await worker.run_episode.remote(episode, stage)
        except self._ray.exceptions.RayActorError as exc:
            self._replace(index, worker)
            return _lost(self.spec.env, episode, f"rollout worker {index} died: {type(exc).__name__}: {exc}")
        finally:
            self._load[index] -= 1

    def stage(self, stage: int) -> EpisodeRunner:
        """The runner of a curriculum stage (``WorkerSpec.stages``): these workers, on that stage's engines."""
        if not 0 <= stage < len(self.spec.stages):
            raise ValueError(f"these workers know {len(self.spec.stages)} curriculum stages, not stage {stage}")
        return _Stage(self, stage)

    def load_weights(self, model: torch.nn.Module) -> None:
        """Every worker's generator takes ``model``'s weights (a PEFT model's adapters merged in), broadcast to all of
        them at once; the transfer group is formed again when a worker was replaced since the last sync."""
        from trajlab.inference.weights import full_weights

        self._weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in full_weights(model)}
        self._description = weight_broadcast.describe(self._weights.items())
        if self._group_workers != self.workers:
            self._group = self._form_group(self.workers)
            self._group_workers = list(self.workers)
        self.sent_bytes += self._broadcast(self._group, self.workers)

    def _form_group(self, workers: list[Any]) -> Any:
        """A transfer group of the trainer (rank 0, serving the rendezvous on this node) and ``workers``."""
        host, port = self._rendezvous()
        joined = [worker.join_weight_group.remote(host, port, rank, len(workers) + 1)
                  for rank, worker in enumerate(workers, start=1)]
        group = weight_broadcast.open_group(host, port, 0, len(workers) + 1)
        self._ray.get(joined)
        return group

    def _rendezvous(self) -> tuple[str, int]:
        """This node's address, as Ray knows it, and a free port on it."""
        host = self._ray.util.get_node_ip_address()
        return host, weight_broadcast.free_port(host)

    def _broadcast(self, group: Any, workers: list[Any]) -> int:
        """Send the latest weights over ``group``, which ``workers`` receive; the bytes sent."""
        assert self._weights is not None
        received = [worker.receive_weights.remote(self._description) for worker in workers]
        sent = weight_broadcast.send(group, self._weights.items(), self._description)
        self._ray.get(received)
        return sent

    def present(self, system_prompt: str, tool_descriptions: dict[str, str]) -> None:
        """Every worker shows the model this system prompt and these tool descriptions from now on (prompt
        evolution evaluates one candidate at a time)."""
        self._presented = (system_prompt, dict(tool_descriptions))
        self._ray.get([worker.present.remote(*self._presented) for worker in self.workers])

    def sleep(self) -> None:
        """Nothing: the workers' memory is their own processes', not the trainer's."""

    def wake_up(self) -> None:
        """Nothing (see :meth:`sleep`)."""

    def pids(self) -> list[int]:
        """The workers' process ids (to watch them, or, in a test, to kill one)."""
        return self._ray.get([worker.pid.remote() for worker in self.workers])

    def close(self) -> None:
        """Stop the workers, and the Ray cluster if this runner started it."""
        for worker in self.workers:
            with contextlib.suppress(Exception):  # a dead or stuck worker: killed below all the same
                self._ray.get(worker.close.remote(), timeout=30)
            self._ray.kill(worker)
        self.workers = []
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False
        if self._own_temp_dir is not None:
            shutil.rmtree(self._own_temp_dir, ignore_errors=True)
            self._own_temp_dir = None
        if self._linked_temp_dir is not None:
            _move_into_run(*self._linked_temp_dir)
            self._linked_temp_dir = None

    def _replace(self, index: int, dead: Any) -> None:
        """A fresh worker in place of a dead one (once, however many of its episodes report the death)."""
        if self.workers[index] is not dead:
            return
        logger.warning("rollout worker %d died; starting a new one", index)
        held = self._weights is not None or self._presented is not None
        fresh = self._actor.remote(self.spec, held)
        if held:  # the weights last sent and the prompt shown, before any episode of its
            rendezvous = self._rendezvous() if self._weights is not None else None
            call = fresh.take_over.remote(rendezvous, self._description, self._presented)
            if rendezvous is not None:
                threading.Thread(target=self._send_to, args=(*rendezvous, self._weights, self._description, [call]),
                                 name="trajlab-worker-weights", daemon=True).start()
        self.workers[index] = fresh
        self.replaced += 1

    def _send_to(self, host: str, port: int, weights: dict[str, torch.Tensor], description: dict[str, list],
                 calls: list[Any]) -> None:
        """Serve a replacement's own transfer group and send it ``weights`` (in a thread: the runner's event loop
        goes on meanwhile; the replacement's episodes queue behind ``calls``, its join and receive)."""
        try:
            group = weight_broadcast.open_group(host, port, 0, 2)
            sent = weight_broadcast.send(group, weights.items(), description)
            self._ray.get(calls)
            self.sent_bytes += sent
        except Exception:  # the replacement died too: its episodes come back as errors and it is replaced again
            logger.exception("rollout worker replacement: sending it the weights failed")

    def _start_ray(self, address: str, run_dir: str | Path | None, cpus: float) -> None:
        options: dict[str, Any] = {"include_dashboard": False, "configure_logging": False, "log_to_driver": False}
        if address == "local":
            if run_dir is None:
                temp_dir = self._own_temp_dir = tempfile.mkdtemp(prefix="trajlab-ray-")
            else:
                temp_dir = _temp_dir(Path(run_dir))
                link = Path(run_dir).resolve() / "ray"
                if link.is_symlink() and os.readlink(link) == temp_dir:
                    self._linked_temp_dir = (temp_dir, link)
            options |= {"num_cpus": max(int(cpus + 0.999), os.cpu_count() or 1), "_temp_dir": temp_dir}
        else:
            options["address"] = address
        self._ray.init(**options)
        self._started_ray = True


class _Stage(EpisodeRunner):
    """A curriculum stage's view of a :class:`RayRolloutRunner`: its episodes run on that stage's engines. The stages
    share the workers, so closing any of them closes the runner (a training run closes them all at its end)."""

    def __init__(self, runner: RayRolloutRunner, stage: int) -> None:
        self.runner, self.index = runner, stage

    async def run_episode(self, episode: Episode) -> Trajectory:
        return await self.runner.run_episode(episode, self.index)

    def close(self) -> None:
        self.runner.close()


def _temp_dir(run_dir: Path) -> str:
    """``run_dir/ray`` when its socket paths fit the kernel's limit; else a short directory, linked as ``run_dir/ray``
    so the cluster's logs are still found from the run."""
    wanted = run_dir.resolve() / "ray"
    if len(str(wanted)) <= MAX_SOCKET_DIR:
        wanted.mkdir(parents=True, exist_ok=True)
        return str(wanted)
    short = tempfile.mkdtemp(prefix="trajlab-ray-")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not wanted.is_symlink() and not wanted.exists():
        wanted.symlink_to(short, target_is_directory=True)
    return short


def _move_into_run(short: str, link: Path) -> None:
    """Once the cluster is down, put its files (logs) where the run links them, so nothing stays in /tmp; its
    sockets, dead now, are dropped (they cannot be copied)."""
    for root, _, names in os.walk(short):
        for name in names:
            path = os.path.join(root, name)
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
    if link.is_symlink() and os.readlink(link) == short:
        link.unlink()
        shutil.move(short, link)
    else:  # the run directory was changed meanwhile: keep nothing outside it
        shutil.rmtree(short, ignore_errors=True)


def _lost(env: EnvSpec | EnvMixture, episode: Episode, cause: str) -> Trajectory:
    """The record of an episode whose worker died under it: status error, the cause, nothing else known."""
    name = env.spec_for(episode.task).name if isinstance(env, EnvMixture) else env.name
    return Trajectory(id=episode.id, env=name, task=episode.task, messages=[], tools=[], reward=0.0, status="error",
                      stop_reason="exception", error=cause, split=episode.split, group=episode.group)

