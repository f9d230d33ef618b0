"""benchmarks/serve_rss.py run small: a real `trajlab serve`, a short warm-up, one call of a few hostile kinds, and its
table; so the benchmark that BENCHMARKS.md quotes cannot break unseen."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow(19)
def test_serve_rss_runs_a_small_hostile_mix_and_prints_its_table():
    kinds = "huge_body,many_messages,bad_json,bad_http,vanish,stream"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "serve_rss.py"), "--warmup", "4", "--requests", "6", "--clients",
         "2", "--kinds", kinds, "--settle", "1.5"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "4 warm-up calls {'200': 4}" in out, out
    for kind, status in [("huge_body", "400"), ("many_messages", "400"), ("bad_json", "400"), ("bad_http", "400"),
                         ("vanish", "left"), ("stream", "200")]:
        assert re.search(rf"\| {kind} \| {status} x1 \|", out), (kind, out)
    for label in ("after warm-up", "peak, hostile mix", "after"):
        assert re.search(rf"\| {label} \| \d+ \| \d\.\d\dx \|", out), (label, out)
