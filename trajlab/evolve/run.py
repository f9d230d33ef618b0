"""The evolve recipe: ``gepa.optimize`` over a trajlab adapter, then a result folder anyone can read.

``OUT/gepa/`` is GEPA's run directory: its state is saved every iteration, so running the same command again
resumes from there (a larger ``max_metric_calls`` continues the search). ``OUT/result/`` holds ``best_prompt.txt``,
``candidates.json`` (every candidate with its validation scores and parents) and ``summary.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gepa
from gepa.core.data_loader import DataLoader
from gepa.strategies.eval_policy import FullEvaluationPolicy

from trajlab.evolve.adapter import COMPONENT, TrajlabAdapter
from trajlab.evolve.reflection import ReflectionLM

STATE_FILE = "gepa_state.bin"
RUN_FILE = "trajlab_run.json"


class _ResumingEvaluation(FullEvaluationPolicy):
    """GEPA's full validation, minus re-scoring the seed prompt when a saved state is about to be loaded.

    gepa 0.1.4 evaluates the seed on the whole validation set before it looks for a saved state, then discards
    that evaluation when it loads one; asking for no seed examples on resume saves those rollouts.
    """

    def __init__(self, run_dir: Path) -> None:
        self.resuming = (run_dir / STATE_FILE).exists()

    def get_seed_eval_batch(self, loader: DataLoader) -> list[Any]:
        return [] if self.resuming else list(loader.all_ids())


def run_evolve(
    adapter: TrajlabAdapter,
    reflection_lm: ReflectionLM,
    trainset: list[dict[str, Any]],
    valset: list[dict[str, Any]],
    *,
    seed_prompt: str,
    out: str | Path,
    max_metric_calls: int,
    reflection_minibatch_size: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Evolve the system prompt; returns the summary also written to ``OUT/result/summary.json``.

    A rollout is one metric call: every episode GEPA asks for (minibatches and validation) counts once.
    """
    out = Path(out)
    run_dir = out / "gepa"
    policy = _ResumingEvaluation(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_same_run(run_dir, {"seed_prompt": seed_prompt, "train_tasks": _task_keys(trainset),
                              "val_tasks": _task_keys(valset), "seed": seed}, resuming=policy.resuming)
    result = gepa.optimize(
        seed_candidate={COMPONENT: seed_prompt},
        trainset=trainset,
        valset=valset,
        adapter=adapter,
        reflection_lm=reflection_lm,
        candidate_selection_strategy="pareto",
        reflection_minibatch_size=reflection_minibatch_size,
        max_metric_calls=max_metric_calls,
        run_dir=os.fspath(run_dir),
        val_evaluation_policy=policy,
        seed=seed,
    )
    return write_result(result, out / "result", resumed=policy.resuming, max_metric_calls=max_metric_calls)


def _check_same_run(run_dir: Path, settings: dict[str, Any], *, resuming: bool) -> None:
    """GEPA resumes whatever state the run directory holds; refuse to resume it with other tasks or seed prompt."""
    path = run_dir / RUN_FILE
    if resuming and path.exists():
        saved = json.loads(path.read_text())
        changed = [name for name, value in settings.items() if saved.get(name) != value]
        if changed:
            raise ValueError(f"{run_dir} holds a run with a different {', '.join(changed)}; resume it with the same "
                             "settings, or pass a new --out.")
    path.write_text(json.dumps(settings, indent=2) + "\n")


def _task_keys(tasks: list[dict[str, Any]]) -> list[str]:
    return [str(task.get("task_id", json.dumps(task, sort_keys=True, default=str))) for task in tasks]


def write_result(result: Any, folder: Path, *, resumed: bool, max_metric_calls: int) -> dict[str, Any]:
    """``best_prompt.txt``, ``candidates.json`` and ``summary.json`` from a ``GEPAResult``."""
    folder.mkdir(parents=True, exist_ok=True)
    best = result.best_idx
    candidates = [
        {
            "index": index,
            COMPONENT: candidate[COMPONENT],
            "parents": [parent for parent in result.parents[index] if parent is not None],
            "val_score": result.val_aggregate_scores[index],
            "val_scores": {str(key): value for key, value in result.val_subscores[index].items()},
            "rollouts_at_discovery": result.discovery_eval_counts[index],
        }
        for index, candidate in enumerate(result.candidates)
    ]
    summary = {
        "rollouts": result.total_metric_calls,
        "max_metric_calls": max_metric_calls,
        "candidates": len(candidates),
        "best_index": best,
        "best_val_score": result.val_aggregate_scores[best],
        "seed_val_score": result.val_aggregate_scores[0],
        "seed_prompt": result.candidates[0][COMPONENT],
        "resumed": resumed,
    }
    (folder / "best_prompt.txt").write_text(result.candidates[best][COMPONENT])
    (folder / "candidates.json").write_text(json.dumps(candidates, indent=2) + "\n")
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
