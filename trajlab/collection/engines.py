"""What rolls a collection out: the policy a user named, and its engine built from the validated settings, in this
process or on Ray workers (:mod:`trajlab.collection.workers`), which build theirs the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trajlab.chat.parsers import get_parser
from trajlab.collection.demonstrators import Demonstrator
from trajlab.config import ModelSettings, RolloutSettings
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.errors import UserError
from trajlab.inference.base import SamplingParams
from trajlab.inference.policy import Policy, PolicyLike, load_policy
from trajlab.rollout.engine import MixtureEngine, RolloutEngine, make_engine
from trajlab.rollout.runner import EpisodeRunner


def load_rollout_policy(env: EnvSpec | EnvMixture, policy: PolicyLike | Policy, *, model: ModelSettings,
                        rollout: RolloutSettings, tokenizer: Any, demonstrator: Demonstrator | None) -> Policy:
    """The generator, tokenizer and chat template of ``policy`` (see :func:`load_policy`), a model directory placed
    as ``model`` says, batching up to ``rollout.concurrency`` turns, a server given ``rollout.server_timeout_s`` a
    turn; for the oracle, ``demonstrator``'s reference under its name.

    Raises:
        UserError: the env's tools return images and the policy is a text model.
    """
    oracle = demonstrator.reference if demonstrator is not None else env.oracle
    loaded = load_policy(policy, tokenizer=tokenizer, oracle=oracle, device=model.device, dtype=model.dtype,
                         backend=model.backend, max_batch_size=rollout.concurrency, vision=env.shows_images,
                         template_kwargs=model.chat_template_kwargs, engine_args=model.engine_args(),
                         vllm_batching=model.vllm.batching, server_timeout_s=rollout.server_timeout_s)
    if demonstrator is not None:
        loaded.generator.name = demonstrator.name  # each trajectory's policy
    if env.shows_images and loaded.processor is None:
        raise UserError(f"{env.name}'s tools return images, and the policy's model is a text model (no image "
                        "processor): use a vision-language model directory (e.g. `trajlab model init --vision DIR`) "
                        "as --policy, or as --tokenizer for the oracle.")
    return loaded


def resolve_prompts(env: EnvSpec | EnvMixture, rollout: RolloutSettings
                    ) -> tuple[EnvSpec | EnvMixture, RolloutSettings]:
    """The env with a prompt file's tool descriptions, and the settings with its system prompt in place of the file:
    what a worker on another machine can roll out with, where the file may not exist."""
    shown, system_prompt = rollout.prompted(env)
    return shown, rollout.model_copy(update={"system_prompt": system_prompt, "prompt_file": None})


def rollout_engine(env: EnvSpec | EnvMixture, policy: Policy, *, rollout: RolloutSettings, temperature: float,
                   seed: int, limits: dict[str, int | float] | None = None) -> RolloutEngine | MixtureEngine:
    """The engine rolling ``policy`` out on ``env`` with the rollout settings' parser, prompts and limits (``limits``:
    other overrides, e.g. a curriculum stage's), sampling at ``temperature``, each turn seeded from ``seed``."""
    shown, system_prompt = rollout.prompted(env)
    return make_engine(shown, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                       parser=get_parser(rollout.parser, policy.tokenizer),
                       sampling=SamplingParams(temperature=temperature),
                       limits=rollout.limit_overrides() if limits is None else limits, system_prompt=system_prompt,
                       seed=seed, processor=policy.processor, context=policy.context)


def build_runner(env: EnvSpec | EnvMixture, policy: PolicyLike | Policy, *, rollout: RolloutSettings,
                 model: ModelSettings, temperature: float, seed: int, tokenizer: Any,
                 demonstrator: Demonstrator | None, run_dir: Path) -> EpisodeRunner:
    """The runner of a collection: an engine in this process, or ``rollout.workers`` Ray actors (each building the
    policy from its name; their cluster's files under ``run_dir``).

    Raises:
        UserError: workers asked for with a built policy or tokenizer, or with a demonstrator other than the env's
            own reference.
    """
    env, rollout = resolve_prompts(env, rollout)
    if not rollout.workers:
        loaded = load_rollout_policy(env, policy, model=model, rollout=rollout, tokenizer=tokenizer,
                                     demonstrator=demonstrator)
        return rollout_engine(env, loaded, rollout=rollout, temperature=temperature, seed=seed)
    from trajlab.collection.workers import RayRolloutRunner, WorkerSpec

    if not isinstance(policy, str | Path) or not isinstance(tokenizer, str | Path | None):
        raise UserError("rollout.workers build their policies from names: pass the policy as 'oracle', a model "
                        "directory or a server URL, and the tokenizer as a directory.")
    if demonstrator is not None and demonstrator.name != "oracle":
        raise UserError("collect.reference and reference_noise run in this process only: set rollout.workers to 0 "
                        "to collect their demonstrations.")
    spec = WorkerSpec(env=env, policy=str(policy), tokenizer=None if tokenizer is None else str(tokenizer),
                      model=model, rollout=rollout, temperature=temperature, seed=seed)
    return RayRolloutRunner(spec, run_dir=run_dir)
