"""``trajlab report``: one self-contained HTML file that shows a run, its curves and every trajectory, token by token.

``build`` gathers the data, ``page.html`` is the viewer (plain JavaScript and inline SVG, nothing fetched), and
:func:`write_report` puts the two together.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from trajlab.report.build import gather


def write_report(sources: Iterable[str | Path], out: str | Path, *, max_trajectories: int = 10_000) -> Path:
    """Write the report of run directories and/or trajectory files to ``out`` (one HTML file); returns its path.

    The data is embedded as JSON in the page, which renders it in the browser lazily (a page of trajectories at a
    time, a trajectory's turns and tokens when it is opened), so 10,000 trajectories open in a few seconds.
    """
    sources = list(sources)
    data = gather(sources, max_trajectories=max_trajectories)
    page = resources.files("trajlab.report").joinpath("page.html").read_text(encoding="utf-8")
    embedded = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(page.replace("__TRAJLAB_DATA__", embedded, 1), encoding="utf-8")
    partial.replace(out)
    return out


__all__ = ["gather", "write_report"]
