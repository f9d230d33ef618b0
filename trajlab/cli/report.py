"""``trajlab report``: a run or trajectory files as one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trajlab.cli.common import console


def report(
    sources: Annotated[list[Path], typer.Argument(help="A run directory of `trajlab run`, and/or trajectory files "
                                                  "(JSONL).")],
    out: Annotated[Path | None, typer.Option(help="The HTML file (default: RUN_DIR/report.html for one run "
                                             "directory, else report.html here).")] = None,
    max_trajectories: Annotated[int, typer.Option(min=1, help="Trajectories put in the page, in file order; the "
                                                  "rest are counted.")] = 10_000,
) -> None:
    """Write one HTML file that opens offline: configuration, stages, evaluations side by side, learning curves, and
    a trajectory browser with a token view (loss mask, logprobs, each turn's reward and advantage)."""
    from trajlab.report import write_report

    if out is None:
        out = sources[0] / "report.html" if len(sources) == 1 and sources[0].is_dir() else Path("report.html")
    path = write_report(sources, out, max_trajectories=max_trajectories)
    console.print(f"Wrote {path} ({path.stat().st_size / 1e6:.1f} MB): open it in a browser")
