"""The report's first screen answers "did it learn?": the evaluations side by side, what each training stage fixed and
broke, the headline curves smoothed, one-point metrics as numbers, and only then the config and stage tables."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

import trajlab
from tests.evaluation.runs import run_a
from trajlab.cli import app
from trajlab.env import load_env
from trajlab.evaluation import compare_reports, evaluate_trajectories, load_report, save_report
from trajlab.report import browser, gather
from trajlab.report.summary import ema, smoothing_weight, stages_between, success_stderr

CONFIG = """run_dir: {run_dir}
env: arithmetic
stages: [eval, collect, sft, eval, rl, eval]
rollout: {{max_turns: 4, max_new_tokens: 32, concurrency: 16}}
collect: {{episodes: 8}}
sft: {{max_steps: 4, batch_size: 2, warmup_steps: 0, logging_steps: 1}}
rl: {{steps: 4, tasks_per_step: 2, group_size: 2, minibatch_size: 4, kl_coef: 0.01}}
eval: {{num_tasks: 2}}
"""
STAND_INS = (("eval-0-untrained", "untrained", 0.7, 0), ("eval-1-sft", "sft", 0.35, 1), ("eval-2-rl", "rl", 0.35, 2))
"""Each evaluation of the run redone by the reference policy with mistakes on purpose: (folder, label, noise, seed)."""
TASKS = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real `trajlab run` of the tiny model (config, stages, SFT and RL curves, trajectories) whose three
    evaluations are then redone by a stand-in whose success changes between them: the oracle with mistakes made on
    purpose (``reference_noise``, seeded), on the same 12 test tasks twice each. The tiny model solves nothing, so
    its own evaluations would show no task fixed or broken."""
    folder = tmp_path_factory.mktemp("first-screen")
    config = folder / "config.yaml"
    config.write_text(CONFIG.format(run_dir=folder / "run"))
    result = CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    run = folder / "run"
    tasks = [task for task, _ in zip(load_env("arithmetic").iter_tasks("test", 0), range(TASKS), strict=False)]
    for name, label, noise, seed in STAND_INS:
        (run / name / "trajectories.jsonl").unlink()
        episodes = trajlab.collect("arithmetic", "oracle", out=run / name / "trajectories.jsonl", tasks=tasks,
                                   episodes=2 * TASKS, samples_per_task=2, reference_noise=noise, seed=seed)
        save_report(evaluate_trajectories(episodes, label=label), run / name / "eval.json")
    return run


def test_the_first_screen_data_says_what_each_stage_changed(run):
    data = gather([run])
    reports = [load_report(run / name / "eval.json") for name, *_ in STAND_INS]
    assert [(b["label"], b["success"], b["tasks"]) for b in data["eval_bars"]] == [
        (r.label, r.success_rate, TASKS) for r in reports]
    for bar, report in zip(data["eval_bars"], reports, strict=True):
        # every task here is solved in both or neither of its episodes: the error is the binomial one over tasks
        solved = sum(t.successes == t.n for t in report.tasks) / TASKS
        assert bar["stderr"] == pytest.approx(math.sqrt(solved * (1 - solved) / (TASKS - 1)))
    assert [t["stages"] for t in data["transitions"]] == [["collect", "sft"], ["rl"]]
    for transition, (before, after) in zip(data["transitions"], zip(reports, reports[1:], strict=False), strict=True):
        deltas = [row["delta"] for row in compare_reports(before, after)["tasks"]]
        assert len(transition["fixed"]) == sum(d > 0 for d in deltas)
        assert len(transition["broke"]) == sum(d < 0 for d in deltas)
        assert transition["compared"] == TASKS and transition["only_before"] == transition["only_after"] == 0
    assert len(data["transitions"][0]["fixed"]) > 0 and len(data["transitions"][1]["broke"]) > 0

    stages = {row["stage"]: row for row in data["headline"]}
    assert list(stages) == ["sft", "rl"], "training stages in run order"
    rl_charts = {chart["metric"]: chart for chart in stages["rl"]["charts"]}
    assert list(rl_charts) == ["reward/mean", "rollout/success_rate", "loss/policy", "loss/kl", "loss/entropy"]
    raw = [value for _, value in rl_charts["loss/entropy"]["points"]]
    assert len(raw) == 4 and rl_charts["loss/entropy"]["smooth"] == pytest.approx(ema(raw, 0.6), abs=1e-6)
    assert [c["metric"] for c in stages["sft"]["charts"]] == ["loss/sft", "loss/entropy"]
    assert [n["metric"] for n in stages["sft"]["numbers"]] == ["loss/sft_mean"], "logged once: a number"


def test_success_stderr_is_clustered_by_task_and_unknown_for_one_task():
    report = evaluate_trajectories(run_a(), ks=(1,))  # tasks: 2 of 3, 0 of 2, 1 of 4 successes
    n, rate = 9, 3 / 9
    spread = (2 - 3 * rate) ** 2 + (0 - 2 * rate) ** 2 + (1 - 4 * rate) ** 2
    assert success_stderr(report) == pytest.approx(math.sqrt(3 / 2 * spread) / n)
    one_task = evaluate_trajectories([t for t in run_a() if t.env == "guess"], ks=(1,))
    assert len(one_task.tasks) == 1 and success_stderr(one_task) is None


def test_the_ema_is_debiased_and_its_weight_grows_with_the_run():
    assert ema([2.0, 4.0], 0.5) == pytest.approx([2.0, (0.5 * 1.0 + 0.5 * 4.0) / 0.75])
    assert ema([3.0, 3.0, 3.0], 0.9) == pytest.approx([3.0, 3.0, 3.0]), "a flat curve stays flat"
    assert [smoothing_weight(n) for n in (2, 10, 50, 1000)] == [0.6, 0.6, 0.9, 0.95]


def test_stages_between_evaluations_are_named_only_when_the_config_matches():
    assert stages_between(["eval", "collect", "sft", "eval", "rl", "eval"], 3) == [["collect", "sft"], ["rl"]]
    assert stages_between(["sft", "eval"], 2) == [[]], "an eval the config does not list: nothing named"


@pytest.mark.skipif(browser.missing() is not None, reason=f"no headless browser: {browser.missing()}")
def test_the_first_screen_shows_the_answer_before_the_tables(run, tmp_path):
    page = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(page)])
    assert result.exit_code == 0, result.stdout
    data = gather([run])
    with browser.chromium(height=1000) as driver:
        browser.open_report(driver, page)
        assert browser.console_errors(driver) == []
        find = driver.find_elements
        top = lambda css: driver.execute_script(  # noqa: E731 (the y of an element on the page, scrolled or not)
            "return arguments[0].getBoundingClientRect().top + window.scrollY",
            driver.find_element("css selector", css))
        order = ["#evaluations", "#fixed-broke", "#training", "#run", "#all-metrics", "#trajectories"]
        positions = {css: top(css) for css in order}
        assert list(positions.values()) == sorted(set(positions.values())), positions
        assert top("#eval-chart svg") < 1000, "the evaluations chart is on the first screen"
        assert [h.text for h in find("css selector", "#run h2")][:2] == ["Configuration", "Stages"]

        bars = find("css selector", "#eval-chart g.bar")
        assert [b.get_attribute("data-eval") for b in bars] == [name for name, *_ in STAND_INS]
        heights = [float(b.find_element("tag name", "rect").get_attribute("height")) for b in bars]
        best = max(range(len(bars)), key=lambda i: data["eval_bars"][i]["success"])
        full = heights[best] / data["eval_bars"][best]["success"]
        for bar, height, row in zip(bars, heights, data["eval_bars"], strict=True):
            assert height == pytest.approx(full * row["success"], abs=0.01), "bar heights are success rates"
            assert row["stderr"] is not None and bar.find_elements("css selector", "path.stderr"), "whiskers"

        lists = find("css selector", "#fixed-broke details.tasks")
        assert lists and not any(d.get_attribute("open") for d in lists), "the task lists start collapsed"
        assert not any(d.find_elements("tag name", "table") for d in lists), "and their rows are not built yet"
        counts = [int(b.text) for b in find("css selector", "#fixed-broke .count b")]
        assert counts == [len(t[kind]) for t in data["transitions"] for kind in ("fixed", "broke")]
        lists[0].find_element("tag name", "summary").click()
        assert lists[0].get_attribute("open") is not None
        assert len(lists[0].find_elements("css selector", "tbody tr")) == len(data["transitions"][0]["fixed"])

        charts = find("css selector", "#training .curve")
        assert len(charts) == 7 and all("EMA weight 0.60" in chart.text for chart in charts)
        lines = [[chart.find_element("css selector", f"polyline.{kind}").get_attribute("points").split()
                  for kind in ("raw", "ema")] for chart in charts]
        assert all(len(raw) == len(smooth) >= 2 for raw, smooth in lines)
        assert any(raw != smooth for raw, smooth in lines), "the EMA line is drawn over the raw one, not instead"
        numbers = {n.get_attribute("data-metric") for n in find("css selector", "#training .number")}
        assert numbers == {"sft: loss/sft_mean"}
        one_point = {f"sft: {name}" for name, points in data["curves"]["sft"].items() if len(points) == 1}
        shown = {n.get_attribute("data-metric") for n in find("css selector", "#all-metrics .number")}
        assert one_point and one_point <= shown, "every one-point metric is a number"
        assert not one_point & {c.get_attribute("data-metric") for c in find("css selector", "#all-metrics .curve")}
        assert browser.console_errors(driver) == []
