"""Gather a run (or trajectory files) into the data of one self-contained HTML report.

A run directory gives its configuration (``config.yaml``), its stages (the directories ``trajlab run`` writes),
its evaluations (``eval-*/eval.json``), its learning curves (``*/metrics.jsonl``) and its trajectories
(``demos.jsonl``, ``eval-*/trajectories.jsonl``, ``rl/rollouts.jsonl``, ``evolve/gepa/rollouts.jsonl``); from its
evaluations and curves, :mod:`trajlab.report.summary` computes the first screen. Token ids are
turned into text once per distinct id, with the tokenizer of the run's model when one is found, so the page stays
small: a trajectory carries ids, the page the vocabulary it uses.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from trajlab.chat.template import image_ids
from trajlab.data.store import read_trajectories
from trajlab.evaluation import EvalReport, load_report
from trajlab.evaluation.metrics import metric_names, metric_value
from trajlab.report import summary
from trajlab.rollout.types import Trajectory, task_id

logger = logging.getLogger(__name__)

TRAJECTORY_FILES = ("demos.jsonl", "*/trajectories.jsonl", "*/rollouts.jsonl", "*/gepa/rollouts.jsonl")
"""Where a run keeps trajectories, relative to the run directory."""
MAX_TEXT = 4000
"""Longer message texts are cut in the page (the trajectory files keep them whole)."""


def gather(sources: Iterable[str | Path], *, max_trajectories: int = 10_000) -> dict[str, Any]:
    """The report's data from run directories and trajectory files (JSONL).

    Raises:
        FileNotFoundError: a source does not exist.
        ValueError: nothing to report (no trajectories, evaluations or metrics).
    """
    data: dict[str, Any] = {"title": "", "config": "", "stages": [], "evals": [], "eval_bars": [], "transitions": [],
                            "curves": {}, "headline": [], "trajectories": [], "vocab": {}, "images": {}, "omitted": 0}
    files: list[tuple[str, Path]] = []
    tokenizer_dirs: list[Path] = []
    for source in map(Path, sources):
        if not source.exists():
            raise FileNotFoundError(2, "no such run directory or trajectory file", str(source))
        if source.is_dir():
            _gather_run(source, data, files)
            tokenizer_dirs += [source / "rl" / "final", source / "sft" / "final", source / "model"]
        else:
            files.append((source.stem, source))
    data["title"] = data["title"] or ", ".join(str(Path(s)) for s in sources)
    trajectories = []
    for name, path in files:
        for trajectory in read_trajectories(path):
            if len(trajectories) >= max_trajectories:
                data["omitted"] += 1
                continue
            trajectories.append((name, trajectory))
    if not trajectories and not data["evals"] and not data["curves"]:
        raise ValueError(f"nothing to report in {', '.join(map(str, sources))}: no trajectories, eval.json or "
                         "metrics.jsonl (give a run directory of `trajlab run` or a trajectory file)")
    decode = _decoder(tokenizer_dirs + [Path(t.policy) for _, t in trajectories[:1] if t.policy])
    used: set[int] = set()
    for name, trajectory in trajectories:
        row = _trajectory_row(name, trajectory)
        data["trajectories"].append(row)
        for image_id in trajectory.images:  # each image once, as a data URI: the page fetches nothing
            if image_id not in data["images"]:
                data["images"][image_id] = _data_uri(trajectory, image_id)
        if row["tokens"] is not None:
            used.update(row["tokens"]["prompt"])
            used.update(row["tokens"]["ids"])
    data["vocab"] = {str(i): decode(i) for i in sorted(used)} if decode else {}
    return data


def _gather_run(run: Path, data: dict[str, Any], files: list[tuple[str, Path]]) -> None:
    data["title"] = run.resolve().name
    evals = sorted((path.parent for path in run.glob("eval-*/eval.json")), key=_eval_order)
    config = run / "config.yaml"
    stages: list[str] = []
    if config.exists():
        data["config"] = config.read_text()
        stages = yaml.safe_load(data["config"]).get("stages") or []
        data["stages"] = _stages(run, stages, evals)
    reports = [load_report(folder / "eval.json") for folder in evals]
    names = [folder.name for folder in evals]
    data["evals"] = [_eval_row(name, report) for name, report in zip(names, reports, strict=True)]
    data["eval_bars"] = summary.eval_bars(names, reports)
    data["transitions"] = summary.transitions(names, reports, summary.stages_between(stages, len(reports)))
    for metrics in sorted(run.glob("*/metrics.jsonl"), key=lambda path: _stage_order(path.parent.name, stages)):
        data["curves"][metrics.parent.name] = _curves(metrics)
    data["headline"] = summary.headline(data["curves"], stages)
    for pattern in TRAJECTORY_FILES:
        for path in sorted(run.glob(pattern), key=lambda p: _eval_order(p.parent)):
            files.append((str(path.parent.relative_to(run)) if path.parent != run else path.stem, path))


def _stage_order(stage: str, stages: list[str]) -> tuple[int, str]:
    """A training stage's directory in run order: where the config lists it, then by name."""
    return (stages.index(stage) if stage in stages else len(stages), stage)


def _eval_order(path: Path) -> tuple[int, str]:
    """Stage directories in run order: by the number after ``eval-``, then by name."""
    parts = path.name.split("-")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 10**6, path.name)


def _stages(run: Path, stages: list[str], evals: list[Path]) -> list[dict[str, str]]:
    """The configured stages with their result where it exists (``evals``: the eval directories, in run order)."""
    rows, evals = [], list(evals)
    for stage in stages:
        if stage == "eval":
            path = evals.pop(0) if evals else None
            done = path is not None
        elif stage == "collect":
            path, done = run / "demos.jsonl", (run / "demos.jsonl").exists()
        elif stage == "evolve":
            path = run / "evolve" / "result"
            done = (path / "summary.json").exists()
        else:
            path = run / stage / "final"
            done = (path / "config.json").exists()
        rows.append({"stage": stage, "done": "done" if done else "not run",
                     "where": str(path.relative_to(run)) if path is not None else ""})
    return rows


def _eval_row(name: str, report: EvalReport) -> dict[str, Any]:
    """An evaluation's name, label and every number it has."""
    numbers = {metric: value for metric in metric_names([report])
               if (value := metric_value(report, metric)) is not None}
    return {"name": name, "label": report.label} | numbers


def _curves(path: Path) -> dict[str, list[list[float]]]:
    """Every numeric metric of a ``metrics.jsonl`` as ``[step, value]`` points."""
    curves: dict[str, list[list[float]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        step = record.get("step")
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float) and step is not None:
                curves.setdefault(name, []).append([step, value])
    return curves


def _trajectory_row(source: str, trajectory: Trajectory) -> dict[str, Any]:
    tokens = trajectory.tokens
    return {
        "source": source, "id": trajectory.id, "env": trajectory.env, "task": task_id(trajectory.task),
        "status": trajectory.status, "reward": trajectory.reward, "stop": trajectory.stop_reason,
        "error": trajectory.error, "turn_rewards": trajectory.turn_rewards,
        "metrics": {k: round(v, 4) for k, v in trajectory.metrics.items()},
        "messages": [_message(m) for m in trajectory.messages],
        "tokens": None if tokens is None else {
            "prompt": tokens.prompt_ids, "ids": tokens.completion_ids, "mask": tokens.loss_mask,
            "lp": _rounded(tokens.logprobs),
            "tlp": None if tokens.trainer_logprobs is None else _rounded(tokens.trainer_logprobs)},
    }


def _rounded(logprobs: list[float | None]) -> list[float | None]:
    return [None if lp is None else round(lp, 3) for lp in logprobs]


def _message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    images = image_ids([message])
    if images:  # the text parts as text; the images shown apart, by id
        text = "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type") == "text")
    else:
        text = content if isinstance(content, str) else json.dumps(content) if content is not None else ""
    row = {"role": message.get("role", ""), "text": text[:MAX_TEXT] + (" [...]" if len(text) > MAX_TEXT else "")}
    if images:
        row["images"] = images
    calls = message.get("tool_calls") or []
    if calls:
        row["calls"] = [{"name": c.get("function", {}).get("name", ""),
                         "arguments": c.get("function", {}).get("arguments", "")} for c in calls]
    if message.get("name"):
        row["name"] = message["name"]
    return row


def _data_uri(trajectory: Trajectory, image_id: str) -> str:
    """An image of the trajectory as a ``data:`` URI (empty when its file is gone: the page says so)."""
    try:
        return "data:image/png;base64," + base64.b64encode(trajectory.image_png(image_id)).decode()
    except OSError as exc:
        logger.warning("trajectory %s: image %s not found (%s)", trajectory.id, image_id, exc)
        return ""


def _decoder(candidates: list[Path]) -> Any:
    """A function from a token id to its text, from the first candidate directory that holds a tokenizer."""
    from trajlab.models.loading import load_tokenizer

    for directory in candidates:
        if (directory / "tokenizer_config.json").exists():
            try:
                tokenizer = load_tokenizer(directory)
            except (OSError, ValueError) as exc:
                logger.warning("cannot load the tokenizer in %s: %s", directory, exc)
                continue
            return lambda token: tokenizer.decode([token])
    logger.warning("no tokenizer found (looked in %s): the token view shows ids only",
                   ", ".join(map(str, candidates)) or "nothing")
    return None
