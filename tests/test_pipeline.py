"""`trajlab run` end to end with tiny budgets, resuming a finished run, and its report opened in Chromium."""

import itertools
import json
import re

import pytest
from typer.testing import CliRunner

from trajlab.cli import app
from trajlab.data.store import read_trajectories, task_keys
from trajlab.env import load_env
from trajlab.report import browser, read_embedded

CONFIG = """# trajlab run config.yaml
run_dir: {run_dir}
env: arithmetic
stages: [eval, collect, sft, eval, rl, eval]
rollout: {{max_turns: 4, max_new_tokens: 32, concurrency: 16}}
collect: {{episodes: 16}}
sft: {{max_steps: 2, batch_size: 4, warmup_steps: 0}}
rl: {{steps: 1, tasks_per_step: 2, group_size: 2, kl_coef: 0.01}}
eval: {{num_tasks: 4}}
"""


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The config and the output of one `trajlab run` of every stage."""
    folder = tmp_path_factory.mktemp("pipeline")
    config = folder / "config.yaml"
    config.write_text(CONFIG.format(run_dir=folder / "run"))
    return config, CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)


def test_run_prints_one_row_per_evaluation_and_resumes(pipeline):
    config, result = pipeline
    runner = CliRunner()
    assert result.exit_code == 0, result.stdout
    for label in ("untrained", "sft", "rl"):
        assert label in result.stdout
    run = config.parent / "run"
    reports = json.loads((run / "results.json").read_text())
    assert [r["label"] for r in reports] == ["untrained", "sft", "rl"]
    assert all("progress" in r["reward_components"] and r["episodes"] == 4 for r in reports)
    for path in ("model/config.json", "demos.jsonl", "sft/final/config.json", "rl/final/config.json",
                 "rl/metrics.jsonl", "eval-0-untrained/eval.json", "eval-2-rl/eval.json", "results.json"):
        assert (run / path).exists(), path
    page = (run / "report.html").read_text()
    data = read_embedded(page)
    assert [e["name"] for e in data["evals"]] == ["eval-0-untrained", "eval-1-sft", "eval-2-rl"]
    assert "reward/mean" in data["curves"]["rl"] and "loss/sft_mean" in data["curves"]["sft"]
    assert any("rl/step" in t["metrics"] for t in data["trajectories"]), "RL's rollouts are in the browser"
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the report fetches nothing"
    demonstrated, trained = task_keys(run / "demos.jsonl"), task_keys(run / "rl" / "rollouts.jsonl")
    assert len(demonstrated) == 16 and "leaving out the 16 train tasks" in result.stdout
    assert trained and trained.isdisjoint(demonstrated), "RL draws train tasks SFT was not fitted to"

    again = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert again.exit_code == 0
    assert "sft: already done" in again.stdout and "rl: already done" in again.stdout


needs_browser = pytest.mark.skipif(browser.missing() is not None, reason=f"no headless browser: {browser.missing()}")


@pytest.fixture(scope="module")
def chromium():
    with browser.chromium() as driver:
        yield driver


@needs_browser
def test_the_run_report_works_in_chromium(pipeline, chromium, tmp_path):
    """The report of the run, opened as a user would: it renders without a console error, shows every metric the RL
    stage logged, filters change the list, and a trajectory opens into turns and tokens."""
    config, result = pipeline
    assert result.exit_code == 0, result.stdout
    run = config.parent / "run"
    rendered_ms = browser.open_report(chromium, run / "report.html")
    assert 0 < rendered_ms < 10_000
    assert browser.console_errors(chromium) == []
    find = chromium.find_elements

    logged = {name for line in (run / "rl" / "metrics.jsonl").open() for name, value in json.loads(line).items()
              if name != "step" and isinstance(value, int | float)}
    shown = {box.get_attribute("data-metric"): box for box in find("css selector", "#all-metrics [data-metric]")}
    assert {f"rl: {name}" for name in logged} <= set(shown), "every metric RL logged is shown"
    reward = shown["rl: reward/mean"]  # one RL step: each metric is one point, shown as a number, not a chart
    assert "number" in reward.get_attribute("class") and not reward.find_elements("tag name", "svg")

    total = sum(1 for pattern in ("demos.jsonl", "*/trajectories.jsonl", "*/rollouts.jsonl")
                for path in run.glob(pattern) for _ in path.open())
    rows = lambda: find("css selector", "#list tbody tr")  # noqa: E731
    count = lambda: chromium.find_element("id", "count").text  # noqa: E731
    assert count().startswith(f"{total} of {total} match") and len(rows()) == min(total, 100)
    source = chromium.find_element("id", "f-source")
    source.find_element("css selector", "option[value='rl']").click()
    shown = rows()
    assert 0 < len(shown) < min(total, 100) and {r.find_element("tag name", "td").text for r in shown} == {"rl"}
    assert not count().startswith(f"{total} of")
    chromium.find_element("id", "f-rmin").send_keys("0.5")
    rewards = [float(r.find_elements("tag name", "td")[5].text) for r in rows()]
    assert all(reward >= 0.5 for reward in rewards) and len(rewards) < len(shown)
    chromium.find_element("id", "f-rmin").clear()
    chromium.execute_script("document.getElementById('f-rmin').dispatchEvent(new Event('input'))")

    rows()[0].click()
    detail = chromium.find_element("id", "detail")
    assert detail.find_elements("css selector", ".turn") and "stop reason" in detail.text
    marks = [m.text for m in detail.find_elements("css selector", ".turnmark")]
    assert marks and all("advantage" in mark for mark in marks), "each RL turn shows its advantage"
    titles = [t.get_attribute("title") for t in detail.find_elements("css selector", ".tokens .tok.model")]
    assert titles and all("sampler logprob" in title and "trainer logprob" in title for title in titles)
    assert browser.console_errors(chromium) == []
    screenshot = tmp_path / "report.png"
    assert chromium.save_screenshot(str(screenshot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000


@needs_browser
def test_the_console_check_sees_a_page_error(chromium, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><body><script>null.render();</script></body>")
    with pytest.raises(TimeoutError, match="TypeError"):
        browser.open_report(chromium, page, timeout_s=2)


def test_run_refuses_a_misspelled_key(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run").replace("max_steps", "max_stepz"))
    result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 1 and "sft.max_stepz: unknown key (did you mean 'max_steps'?)" in result.stdout


def test_rl_draws_no_demonstrated_task_failed_ones_included(tmp_path):
    """SFT learned from the successful demonstrations only, but RL leaves out the failed ones' tasks too: drawn first,
    they would be a sample biased to the demonstrator's mistakes. Its first tasks are the first never demonstrated."""
    config = tmp_path / "config.yaml"
    config.write_text(f"""run_dir: {tmp_path / 'run'}
env: arithmetic
stages: [collect, sft, rl]
rollout: {{max_turns: 4, max_new_tokens: 32, concurrency: 16}}
collect: {{episodes: 16, reference_noise: 0.3}}
sft: {{max_steps: 1, batch_size: 4, warmup_steps: 0}}
rl: {{steps: 1, tasks_per_step: 2, group_size: 2}}
""")
    result = CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    demos = list(read_trajectories(tmp_path / "run" / "demos.jsonl"))
    assert 2 <= sum(t.status != "success" for t in demos) < len(demos) == 16
    assert "leaving out the 16 train tasks" in result.stdout
    in_order = [task["task_id"] for task in itertools.islice(load_env("arithmetic").iter_tasks("train", 0), 18)]
    assert {t.task["task_id"] for t in demos} == set(in_order[:16])
    drawn = [t.task["task_id"] for t in read_trajectories(tmp_path / "run" / "rl" / "rollouts.jsonl")]
    assert list(dict.fromkeys(drawn)) == in_order[16:]
    record = json.loads((tmp_path / "run" / "rl" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["replay/demonstrations"] == sum(t.status != "error" for t in demos), \
        "the default recipe replays the run's demos.jsonl (all of its 16: fewer than 64 a step)"
    assert "rollout/greedy_success_rate" in record, "the default recipe rolls one member of each group out greedily"


def test_a_run_on_an_env_that_shows_images_builds_the_tiny_vision_model(tmp_path):
    """``model.path: null`` builds the tiny model; a text model cannot take odd_one_out's images, so the run builds the
    vision-language one, and every stage sees the pixels."""
    config = tmp_path / "config.yaml"
    config.write_text(f"""run_dir: {tmp_path / 'run'}
env: odd_one_out
stages: [collect, sft, rl, eval]
rollout: {{max_turns: 3, max_new_tokens: 48, concurrency: 8}}
collect: {{episodes: 8}}
sft: {{max_steps: 1, batch_size: 4, warmup_steps: 0}}
rl: {{steps: 1, tasks_per_step: 2, group_size: 2, replay_demonstrations: 0}}
eval: {{num_tasks: 2}}
""")
    result = CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    assert "built the tiny vision-language model" in result.stdout
    model = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert "vision_config" in model
    demos = list(read_trajectories(tmp_path / "run" / "demos.jsonl"))
    assert all(t.images for t in demos if t.status == "success"), "every solved demonstration looked at the grid"
    assert json.loads((tmp_path / "run" / "rl" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


def test_an_evolve_stage_hands_its_prompt_to_the_stages_after_it(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"""run_dir: {tmp_path / "run"}
env: arithmetic
stages: [eval, evolve, eval]
rollout: {{max_turns: 2, max_new_tokens: 16}}
evolve: {{max_metric_calls: 6, train_tasks: 3, val_tasks: 2, reflection_max_new_tokens: 16, tools: [submit]}}
eval: {{num_tasks: 3}}
""")
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    run = tmp_path / "run"
    assert [r["label"] for r in json.loads((run / "results.json").read_text())] == ["untrained", "untrained+evolved"]
    best = json.loads((run / "evolve" / "result" / "best_candidate.json").read_text())
    assert set(best) == {"system_prompt", "tool:submit"}
    seed_ids = [json.loads(line)["id"] for line in (run / "eval-0-untrained" / "trajectories.jsonl").open()]
    evolved_ids = [json.loads(line)["id"] for line in (run / "eval-1-untrained+evolved" / "trajectories.jsonl").open()]
    assert all(":prompt-" in i for i in evolved_ids) and not any(":prompt-" in i for i in seed_ids)
    again = runner.invoke(app, ["run", str(config)], catch_exceptions=False)
    assert again.exit_code == 0 and "evolve: already done" in again.stdout


def test_rollout_prompt_file_is_what_every_stage_shows_the_model(tmp_path, tiny_tokenizer):
    prompts = tmp_path / "best_candidate.json"
    prompts.write_text(json.dumps({"system_prompt": "EVOLVED-SYSTEM-XYZ", "tool:submit": "EVOLVED-SUBMIT-ABC"}))
    config = tmp_path / "config.yaml"
    config.write_text(f"""run_dir: {tmp_path / "run"}
env: arithmetic
stages: [eval]
rollout: {{max_turns: 1, max_new_tokens: 4, prompt_file: {prompts}}}
eval: {{num_tasks: 2}}
""")
    result = CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    line = (tmp_path / "run" / "eval-0-untrained" / "trajectories.jsonl").open().readline()
    prompt = tiny_tokenizer.decode(json.loads(line)["tokens"]["prompt_ids"])
    assert "EVOLVED-SYSTEM-XYZ" in prompt and "EVOLVED-SUBMIT-ABC" in prompt
    assert "Submit the final" not in prompt  # the docstring's description is replaced, not added to
