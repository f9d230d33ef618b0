"""The evolve recipe, :func:`trajlab.evolve`: GEPA evolves the system prompt (and chosen tool descriptions) of a
policy on an env, scored by real rollouts (:mod:`trajlab.evolution`); ``trajlab evolve`` and a run's evolve stage.

The seed candidate is what the policy would be shown now (the rollout's system prompt, else the env's, and the env's
current tool descriptions). Train and validation tasks are the first ``train_tasks + val_tasks`` of the train split,
so the test split stays held out for ``trajlab eval``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trajlab.collection.demonstrators import is_oracle
from trajlab.collection.engines import build_runner, resolve_prompts
from trajlab.config import EvolveSettings, RolloutSettings, VLLMSettings
from trajlab.env.registry import EnvSpec
from trajlab.errors import require
from trajlab.inference.policy import Policy, PolicyLike
from trajlab.recipes.arguments import EnvLike, as_env, model_settings, run_seed, settings_of
from trajlab.tracking import Trackers, require_trackers


def evolve(
    env: EnvLike,
    policy: PolicyLike | Policy,
    out: str | Path,
    *,
    tokenizer: Any = None,
    rollout: RolloutSettings | Mapping[str, Any] | None = None,
    seed: int | None = None,
    backend: str | None = None,
    vllm: VLLMSettings | dict | None = None,
    log: Callable[[str], None] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    report_to: Sequence[str] = (),
    **settings: Any,
) -> dict[str, Any]:
    """Evolve the system prompt (and chosen tool descriptions) of ``policy`` on ``env`` with GEPA.

    Writes ``out/gepa/`` (state and rollouts: calling again resumes) and ``out/result/`` (``best_candidate.json``,
    which ``rollout={"prompt_file": ...}`` rolls out with); returns the summary.

    Args:
        device, dtype: where a model-directory policy and a local reflection model are loaded, in what dtype
            (``ModelSettings``); vllm: the vllm backend's engine arguments (``VLLMSettings``).
        report_to: experiment trackers that get each candidate's validation score and the best so far, at the
            metric calls where it was found (``evolve/...``).
        **settings: ``EvolveSettings`` fields (``reflection``, ``max_metric_calls``, ``train_tasks``...).
        Other arguments: as for :func:`trajlab.collect`.
    """
    require("gepa", feature="trajlab evolve", install="pip install 'trajlab[evolve]'")
    from trajlab.evolution.adapter import TrajlabAdapter
    from trajlab.evolution.candidate import seed_candidate
    from trajlab.evolution.reflection import load_reflection_lm
    from trajlab.evolution.search import evolve_curve, rollouts_path, run_evolve

    require_trackers(report_to)
    chosen, model = settings_of(EvolveSettings, settings), model_settings(device, dtype, backend, vllm)
    seed = run_seed(seed)
    spec, rollout = resolve_prompts(as_env(env), settings_of(RolloutSettings, rollout))
    if not isinstance(spec, EnvSpec):
        raise ValueError("trajlab evolve runs one env; pass a single env.")
    wanted = chosen.train_tasks + chosen.val_tasks
    rows = list(itertools.islice(spec.iter_tasks("train", seed), wanted))
    if len(rows) < wanted:
        raise ValueError(f"'{spec.name}' has {len(rows)} train tasks; train_tasks + val_tasks asks for {wanted}.")
    reflection = chosen.reflection or _own_model(policy)
    tools = [tool["function"]["name"] for tool in spec.tools] if chosen.tools == "all" else chosen.tools
    system_prompt = rollout.system_prompt if rollout.system_prompt is not None else spec.system_prompt or ""
    with build_runner(spec, policy, rollout=rollout, model=model, temperature=chosen.temperature, seed=seed,
                      tokenizer=tokenizer, demonstrator=None, run_dir=rollouts_path(out).parent) as engine:
        reflection_lm = load_reflection_lm(reflection, settings=chosen, model=model,  # after the policy's checks
                                           server_timeout_s=rollout.server_timeout_s)
        adapter = TrajlabAdapter(engine, weights=chosen.rewards, rollout=rollout)
        summary = run_evolve(adapter, reflection_lm, rows[:chosen.train_tasks], rows[chosen.train_tasks:],
                             seed_candidate=seed_candidate(spec, system_prompt, tools), out=out, settings=chosen,
                             seed=seed, log=log)
    with Trackers(report_to, Path(out).parent, Path(out).name,
                  config={"evolve": chosen.model_dump(mode="json"), "seed": seed}) as trackers:
        for calls, values in evolve_curve(Path(out) / "result"):
            trackers.log(values, step=calls)
    return summary


def _own_model(policy: PolicyLike | Policy) -> str:
    """The policy's own model as its reflection LM: a model directory or server URL."""
    if is_oracle(policy):
        raise ValueError("The oracle cannot reflect: give a reflection LM (--reflection or evolve.reflection: a "
                         "model directory or http://host:port/v1#model).")
    return str(policy)
