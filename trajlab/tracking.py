"""Experiment trackers: a stage's metrics also go to TensorBoard, Weights & Biases, Trackio or MLflow.

``report_to`` names any subset (none by default; ``metrics.jsonl`` is always written). The trackers are
accelerate's, each started in its offline or local mode unless the user's environment says otherwise, so a run with
no network works:

- ``tensorboard``: event files under ``RUN_DIR/tensorboard/<stage>`` (``tensorboard --logdir RUN_DIR/tensorboard``);
- ``wandb``: ``WANDB_MODE=offline`` unless ``WANDB_MODE`` or ``WANDB_API_KEY`` is set, files under ``RUN_DIR/wandb``
  (``wandb sync`` uploads them later);
- ``trackio``: Trackio's local database (``TRACKIO_DIR``), project = the run directory's name;
- ``mlflow``: ``MLFLOW_TRACKING_URI``, else a file store in ``RUN_DIR/mlruns``.

Every stage of a run is one tracker run named after the stage (``sft``, ``rl``, ``eval-1-sft``, ``evolve``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, get_args

from trajlab.errors import UserError, require

TrackerName = Literal["tensorboard", "wandb", "trackio", "mlflow"]
TRACKERS: tuple[str, ...] = get_args(TrackerName)
"""The trackers, each also the name of its package and of its extra (``pip install 'trajlab[NAME]'``)."""


def require_trackers(report_to: Sequence[str]) -> None:
    """Fail before any work when a tracker is unknown or its package is missing (the message says what to
    install)."""
    unknown = sorted(set(report_to) - set(TRACKERS))
    if unknown:
        raise UserError(f"report_to: unknown tracker(s) {unknown}; choose from {', '.join(TRACKERS)}.")
    for name in report_to:
        require(name, feature=f"report_to: {name}", install=f"pip install 'trajlab[{name}]'")


class Trackers:
    """The trackers of ``report_to`` for one stage; ``log`` sends numbers to all of them. No trackers: no-ops.

    Args:
        report_to: tracker names (see :data:`TRACKERS`).
        run_dir: the run directory (trackers that write files write them under it).
        stage: the tracker run's name.
        config: the stage's settings, stored with the tracker run (flattened to ``section.key``).
        enabled: False on every process but the main one.
    """

    def __init__(self, report_to: Sequence[str], run_dir: str | Path, stage: str,
                 config: Mapping[str, Any] | None = None, *, enabled: bool = True) -> None:
        require_trackers(report_to)
        self._trackers: list[Any] = []
        if not enabled:
            return
        run_dir = Path(run_dir)
        for name in dict.fromkeys(report_to):
            tracker = _start(name, run_dir, stage)
            if config:
                tracker.store_init_configuration(_flat(config))
            self._trackers.append(tracker)

    def log(self, values: Mapping[str, Any], step: int) -> None:
        """Send the numeric ``values`` at ``step`` (strings, None, and ``values["step"]``, the x-axis, are
        skipped)."""
        numbers = {k: float(v) for k, v in values.items()
                   if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}
        for tracker in self._trackers:
            tracker.log(numbers, step=step)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.finish()
        self._trackers = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def _start(name: str, run_dir: Path, stage: str) -> Any:
    from accelerate import tracking

    project = run_dir.resolve().name or "trajlab"
    if name == "tensorboard":
        tracker = tracking.TensorBoardTracker(stage, run_dir / "tensorboard")
    elif name == "wandb":
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        online = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        tracker = tracking.WandBTracker(project, name=stage, dir=str(run_dir), mode=online)
    elif name == "trackio":
        tracker = tracking.TrackioTracker(project, name=stage)
    else:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        tracker = tracking.MLflowTracker(project, logging_dir=str(run_dir / "mlruns"), run_name=stage)
    tracker.start()
    return tracker


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as ``section.key`` -> a number, bool or string (what every tracker stores)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat |= _flat(value, f"{prefix}{key}.")
        elif isinstance(value, int | float | str | bool):
            flat[f"{prefix}{key}"] = value
        elif value is not None:
            flat[f"{prefix}{key}"] = str(value)
    return flat
