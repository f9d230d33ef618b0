"""eval.json on disk: an atomic round trip, and clear errors naming a bad file."""

from __future__ import annotations

import json

import pytest

from trajlab.evaluation.io import ReportError, load_report, save_report


def test_save_load_round_trip_keeps_plain_metric_names(report_a, tmp_path):
    path = save_report(report_a, tmp_path / "run" / "eval.json")
    loaded = load_report(path)
    assert loaded == report_a
    assert loaded.pass_at.keys() == {1, 2} and loaded.tasks[0].pass_at.keys() == {1, 2, 3}  # int keys come back
    raw = json.loads(path.read_text())
    assert {"label", "episodes", "success_rate", "mean_reward", "tool_error_rate", "parse_error_rate", "pass_at",
            "statuses", "per_env", "reward_components", "tasks"} <= raw.keys()
    assert raw["pass_at"]["1"] == pytest.approx(report_a.pass_at[1])
    assert list(tmp_path.glob("run/*")) == [path]  # no partial file left behind


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such eval report"),
    ("{not json", "not a valid eval report"),
    ('{"label": "x"}', "not a valid eval report"),
    ('{"id": "ep1", "env": "arithmetic"}', "not a valid eval report: id: Extra inputs are not permitted"),
])
def test_a_bad_report_file_is_a_clear_error_naming_it(content, message, tmp_path):
    path = tmp_path / "eval.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ReportError, match=message) as info:
        load_report(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)  # the CLI turns ValueErrors into clean messages


def test_a_report_with_an_unknown_key_is_refused(report_a, tmp_path):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({**json.loads(report_a.model_dump_json()), "succes_rate": 1.0}))
    with pytest.raises(ReportError, match="succes_rate"):
        load_report(path)
