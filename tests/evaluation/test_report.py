"""``trajlab report`` from trajectory files: what the page carries, and the errors on bad input."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

import trajlab
from trajlab.cli import app
from trajlab.report import browser, gather, read_embedded, write_report


@pytest.fixture(scope="module")
def trajectories(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "demos.jsonl"
    trajlab.collect("arithmetic", str(tiny_model_dir), out=out, episodes=6,
                    rollout={"max_turns": 2, "max_new_tokens": 16})
    return out


def test_the_page_carries_every_trajectory_with_its_tokens_and_their_text(trajectories, tmp_path):
    result = CliRunner().invoke(app, ["report", str(trajectories), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.stdout
    page = (tmp_path / "r.html").read_text()
    data = read_embedded(page)
    rows = data["trajectories"]
    assert len(rows) == 6 and {r["source"] for r in rows} == {"demos"}
    for row in rows:
        tokens = row["tokens"]
        assert len(tokens["ids"]) == len(tokens["mask"]) == len(tokens["lp"]) and any(tokens["mask"])
        assert all(str(i) in data["vocab"] for i in tokens["prompt"] + tokens["ids"]), "every token has its text"
        assert all((lp is None) != bool(bit) for lp, bit in zip(tokens["lp"], tokens["mask"], strict=True))
    assert "".join(data["vocab"][str(i)] for i in rows[0]["tokens"]["prompt"]).count("<|im_start|>") >= 2
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the report fetches nothing"


def test_a_cap_counts_what_it_left_out(trajectories):
    data = gather([trajectories], max_trajectories=4)
    assert len(data["trajectories"]) == 4 and data["omitted"] == 2


def test_bad_sources_say_what_is_wrong(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "no such run directory or trajectory file" in result.stdout
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["report", str(tmp_path / "empty")])
    assert result.exit_code == 1 and "nothing to report" in result.stdout


@pytest.fixture(scope="module")
def image_trajectories(tiny_vision_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("report-images") / "looks.jsonl"
    trajlab.collect("odd_one_out", "oracle", out=out, episodes=2, tokenizer=str(tiny_vision_dir))
    return out


def test_images_are_carried_once_as_data_uris_and_named_by_their_messages(image_trajectories):
    data = gather([image_trajectories])
    ids = [image for row in data["trajectories"] for m in row["messages"] for image in m.get("images", [])]
    assert len(ids) == 2 and set(data["images"]) == set(ids)
    assert all(uri.startswith("data:image/png;base64,") for uri in data["images"].values())


@pytest.mark.skipif(browser.missing() is not None, reason=f"no headless browser: {browser.missing()}")
def test_a_tools_image_shows_in_the_trajectory_view(image_trajectories, tmp_path):
    page = write_report([image_trajectories], tmp_path / "report.html")
    with browser.chromium() as driver:
        browser.open_report(driver, page)
        driver.find_elements("css selector", "#list tbody tr")[0].click()
        shots = driver.find_elements("css selector", "#detail img.shot")
        assert len(shots) == 1
        assert driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", shots[0]) == 64
        assert browser.console_errors(driver) == []
