"""``trajlab report``: one self-contained HTML file that shows a run, its curves and every trajectory, token by token.

``build`` gathers the data, ``summary`` the first screen's answer to "did it learn?" (the evaluations side by side,
what each training stage fixed and broke, the headline curves smoothed), ``page.html`` is the viewer (plain
JavaScript and inline SVG, nothing fetched), and :func:`write_report` puts them together.
"""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from trajlab.report.build import gather

DATA_OPEN = '<script id="data" type="application/gzip;base64">'
"""Where the page's data starts: base64 of the gzip-compressed JSON, up to the next ``</script>``."""


def read_embedded(page: str) -> dict:
    """The data a report page carries (for tests and tools that read a report back)."""
    start = page.index(DATA_OPEN) + len(DATA_OPEN)
    return json.loads(gzip.decompress(base64.b64decode(page[start : page.index("</script>", start)])))


def write_report(sources: Iterable[str | Path], out: str | Path, *, max_trajectories: int = 10_000) -> Path:
    """Write the report of run directories and/or trajectory files to ``out`` (one HTML file); returns its path.

    The data is embedded as gzip-compressed JSON in base64 (token ids and logprobs, most of it, compress well: the
    quickstart's 20 MB of JSON become 0.7 MB), which the browser inflates with its own ``DecompressionStream`` and
    renders lazily (a page of trajectories at a time, a trajectory's turns and tokens when it is opened).
    """
    sources = list(sources)
    data = gather(sources, max_trajectories=max_trajectories)
    page = resources.files("trajlab.report").joinpath("page.html").read_text(encoding="utf-8")
    embedded = base64.b64encode(gzip.compress(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode(),
                                              compresslevel=6)).decode("ascii")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(page.replace("__TRAJLAB_DATA__", embedded, 1), encoding="utf-8")
    partial.replace(out)
    return out


__all__ = ["gather", "read_embedded", "write_report"]
