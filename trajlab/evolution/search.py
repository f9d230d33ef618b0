"""The search: ``gepa.optimize`` over a trajlab adapter and a reflection LM, resumable, then a result folder anyone
can read (the evolve recipe, :mod:`trajlab.recipes.evolve`, builds what it searches with).

``OUT/gepa/`` is the run directory: GEPA's state (saved after every iteration), ``rollouts.jsonl`` (every episode,
written as it finishes) and ``gepa.log``. Running the same command again resumes: GEPA reloads its state and every
episode already in ``rollouts.jsonl`` is reused instead of rolled out again, including the ones of an iteration the
interruption cut short. A larger ``max_metric_calls`` continues a finished search. ``OUT/result/`` holds
``best_prompt.txt``, ``best_candidate.json`` (what ``--prompt-file`` reads), ``candidates.json`` (every candidate
with its validation scores and parents) and ``summary.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gepa
from gepa.core.data_loader import DataLoader
from gepa.strategies.eval_policy import FullEvaluationPolicy

from trajlab.config import EvolveSettings
from trajlab.evolution.adapter import TrajlabAdapter
from trajlab.evolution.candidate import SYSTEM_PROMPT, reflection_templates
from trajlab.evolution.reflection import ReflectionLM
from trajlab.rollout.types import task_id

STATE_FILE = "gepa_state.bin"
RUN_FILE = "trajlab_run.json"
ROLLOUTS_FILE = "rollouts.jsonl"
LOG_FILE = "gepa.log"


class _ResumingEvaluation(FullEvaluationPolicy):
    """GEPA's full validation, minus re-scoring the seed prompt when a saved state is about to be loaded.

    gepa 0.1.4 evaluates the seed on the whole validation set before it looks for a saved state, then discards
    that evaluation when it loads one; asking for no seed examples on resume saves those metric calls.
    """

    def __init__(self, run_dir: Path) -> None:
        self.resuming = (run_dir / STATE_FILE).exists()

    def get_seed_eval_batch(self, loader: DataLoader) -> list[Any]:
        return [] if self.resuming else list(loader.all_ids())


class _Log:
    """GEPA's logger: every line to ``gepa.log``, and to ``echo`` (the console) when given."""

    def __init__(self, path: Path, echo: Callable[[str], None] | None) -> None:
        self.path, self.echo = path, echo

    def log(self, message: str) -> None:
        with self.path.open("a") as handle:
            handle.write(message.rstrip("\n") + "\n")
        if self.echo is not None:
            self.echo(message)


def run_evolve(
    adapter: TrajlabAdapter,
    reflection_lm: ReflectionLM,
    trainset: list[dict[str, Any]],
    valset: list[dict[str, Any]],
    *,
    seed_candidate: dict[str, str],
    out: str | Path,
    settings: EvolveSettings,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Evolve the candidate's texts; returns the summary also written to ``OUT/result/summary.json``.

    Every episode GEPA asks for is one metric call; GEPA stops at the first iteration boundary past
    ``settings.max_metric_calls`` (reflection minibatches of ``settings.minibatch_size`` tasks, merges with
    ``settings.use_merge``). Episodes reused from earlier (the same candidate on the same task) are metric calls
    but not new rollouts: ``summary["rollouts"]`` counts the episodes actually run, over all resumes.
    """
    out = Path(out)
    run_dir = rollouts_path(out).parent
    policy = _ResumingEvaluation(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_same_run(run_dir, {"seed_candidate": seed_candidate, "train_tasks": [task_id(t) for t in trainset],
                              "val_tasks": [task_id(t) for t in valset], "seed": seed,
                              "reward_weights": adapter.weights}, resuming=policy.resuming)
    with adapter.recording(rollouts_path(out)) as store:
        earlier = len(store.ids)
        result = gepa.optimize(
            seed_candidate=seed_candidate,
            trainset=trainset,
            valset=valset,
            adapter=adapter,
            reflection_lm=reflection_lm,
            reflection_prompt_template=reflection_templates(seed_candidate) or None,
            candidate_selection_strategy="pareto",
            reflection_minibatch_size=settings.minibatch_size,
            use_merge=settings.use_merge,
            max_metric_calls=settings.max_metric_calls,
            run_dir=os.fspath(run_dir),
            logger=_Log(run_dir / LOG_FILE, log),
            val_evaluation_policy=policy,
            seed=seed,
        )
        rollouts = len(store.ids)
    return write_result(result, out / "result", val_tasks=[task_id(t) for t in valset],
                        max_metric_calls=settings.max_metric_calls,
                        rollouts={"total": rollouts, "this_run": rollouts - earlier}, resumed=policy.resuming)


def rollouts_path(out: str | Path) -> Path:
    """The trajectory file of every episode an evolve run in ``out`` rolled out."""
    return Path(out) / "gepa" / ROLLOUTS_FILE


def _check_same_run(run_dir: Path, settings: dict[str, Any], *, resuming: bool) -> None:
    """GEPA resumes whatever state the run directory holds; refuse to resume it with other tasks or seed texts."""
    path = run_dir / RUN_FILE
    if resuming and path.exists():
        saved = json.loads(path.read_text())
        changed = [name for name, value in settings.items() if saved.get(name) != value]
        if changed:
            raise ValueError(f"{run_dir} holds a run with a different {', '.join(changed)}; resume it with the same "
                             "settings, or pass a new --out.")
    path.write_text(json.dumps(settings, indent=2) + "\n")


def write_result(result: Any, folder: Path, *, val_tasks: list[str], max_metric_calls: int,
                 rollouts: dict[str, int], resumed: bool) -> dict[str, Any]:
    """``best_prompt.txt``, ``best_candidate.json``, ``candidates.json`` and ``summary.json`` from a GEPA result.

    GEPA names validation tasks by their index in ``val_tasks``; the files name them by task id.
    """
    folder.mkdir(parents=True, exist_ok=True)
    best = result.best_idx
    candidates = [
        {
            "index": index,
            "texts": candidate,
            "parents": [parent for parent in result.parents[index] if parent is not None],
            "val_score": result.val_aggregate_scores[index],
            "val_scores": {val_tasks[key]: value for key, value in result.val_subscores[index].items()},
            "metric_calls_at_discovery": result.discovery_eval_counts[index],
        }
        for index, candidate in enumerate(result.candidates)
    ]
    summary = {
        "rollouts": rollouts["total"],
        "rollouts_this_run": rollouts["this_run"],
        "metric_calls": result.total_metric_calls,
        "max_metric_calls": max_metric_calls,
        "candidates": len(candidates),
        "best_index": best,
        "best_val_score": result.val_aggregate_scores[best],
        "seed_val_score": result.val_aggregate_scores[0],
        "evolved": sorted(result.candidates[0]),
        "resumed": resumed,
    }
    (folder / "best_prompt.txt").write_text(result.candidates[best][SYSTEM_PROMPT])
    (folder / "best_candidate.json").write_text(json.dumps(result.candidates[best], indent=2) + "\n")
    (folder / "candidates.json").write_text(json.dumps(candidates, indent=2) + "\n")
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def evolve_curve(result: str | Path) -> list[tuple[int, dict[str, float]]]:
    """The run as a curve for the trackers, from ``result/candidates.json``: at the metric calls where each
    candidate was found, its validation score (``evolve/val_score``) and the best so far
    (``evolve/best_val_score``)."""
    candidates = json.loads((Path(result) / "candidates.json").read_text())
    curve, best = [], float("-inf")
    for candidate in sorted(candidates, key=lambda c: (c["metric_calls_at_discovery"], c["index"])):
        best = max(best, candidate["val_score"])
        curve.append((int(candidate["metric_calls_at_discovery"]),
                      {"evolve/val_score": float(candidate["val_score"]), "evolve/best_val_score": best}))
    return curve
