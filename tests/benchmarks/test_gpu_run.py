"""The GPU measurement script (benchmarks/gpu) run end to end on the CPU at tiny sizes, so the rare GPU run cannot
fail on a typo; and its installer's refusal and pins."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"
MEASUREMENTS = ("rl_step", "rollouts", "async_rl", "sft", "update_memory")
# The smoke run (the module fixture, 165 s in the full suite) is paid by whichever of its tests runs first: one mark
# for all of them keeps them together and at the front of the order (tests/conftest.py).
SMOKE = pytest.mark.slow(165)


def pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {re.sub(r"[-_.]+", "-", name).lower(): version
            for name, version in (line.split("==") for line in lines if "==" in line)}


def test_the_gathered_wheels_are_the_versions_the_tests_pass_with() -> None:
    wanted, tested = pins(GPU / "wheels.txt"), pins(REPO / "constraints.txt")
    assert wanted and {name: tested.get(name) for name in wanted} == wanted


def test_run_sh_refuses_before_measuring_when_a_wheel_is_missing(tmp_path: Path) -> None:
    (tmp_path / "trl-1.16.0-py3-none-any.whl").touch()
    result = subprocess.run(["bash", str(GPU / "run.sh"), "--smoke"], capture_output=True, text=True,
                            env={**os.environ, "TRAJLAB_GPU_WHEELS": str(tmp_path)})
    assert result.returncode == 2
    assert "missing wheels" in result.stderr and "datasets==5.2.0" in result.stderr
    assert "trl==" not in result.stderr.split("missing wheels")[1].split("\n")[0]
    assert "gather_wheels.sh" in result.stderr


def test_run_sh_refuses_when_the_machines_pyarrow_is_too_old_and_none_was_gathered(tmp_path: Path) -> None:
    """pyarrow is not carried by default (the image has one): an image whose pyarrow datasets cannot use is named."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, version in pins(GPU / "wheels.txt").items():
        (wheels / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").touch()
    old = tmp_path / "old" / "pyarrow"  # stands in for an image whose pyarrow predates datasets' floor
    old.mkdir(parents=True)
    (old / "__init__.py").write_text('__version__ = "21.0.0"\n')
    result = subprocess.run(["bash", str(GPU / "run.sh"), "--smoke"], capture_output=True, text=True,
                            env={**os.environ, "TRAJLAB_GPU_WHEELS": str(wheels), "PYTHONPATH": str(old.parent)})
    assert result.returncode == 2, result.stderr
    assert "pyarrow (21.0.0)" in result.stderr and "gather_wheels.sh pyarrow==" in result.stderr


def test_the_full_run_refuses_without_a_gpu(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(GPU / "run.py"), "--out", str(tmp_path)], capture_output=True,
                            text=True)
    assert result.returncode != 0 and "no GPU visible" in result.stderr
    assert not list(tmp_path.iterdir()), "nothing measured"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu_bench")
    result = subprocess.run([sys.executable, str(GPU / "run.py"), "--smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text(), result.stdout


@SMOKE
def test_smoke_runs_every_measurement_and_writes_json_and_markdown(smoke) -> None:
    report, markdown, stdout = smoke
    assert list(report["results"]) == list(MEASUREMENTS)
    assert all(result["status"] == "ok" for result in report["results"].values())
    assert report["commit"] and report["versions"]["trl"] and report["scale"]["smoke"] is True
    for name in MEASUREMENTS:
        assert f"## {name}" in markdown
    assert markdown.count("|---") >= len(MEASUREMENTS), "a table per measurement"
    assert "[gpu-bench" in stdout, "progress is printed"


@SMOKE
def test_rl_step_puts_trl_first_and_its_episodes_take_several_turns(smoke) -> None:
    rows = smoke[0]["results"]["rl_step"]["rows"]
    assert [row["framework"] for row in rows] == ["trl", "trajlab"]
    for row in rows:
        assert row["steps"] == 3 and row["s_per_step"] > 0 and row["peak_gb"] > 0
        assert row["turns_per_episode"] > 1 and row["tool_calls_per_step"] > 0, "the warm start taught tool calls"


@SMOKE
def test_rollouts_compare_the_floor_trajlab_and_continuous_batching_on_the_same_tokens(smoke) -> None:
    result = smoke[0]["results"]["rollouts"]
    assert list(result["sides"]) == ["generate", "trajlab", "continuous"]
    tokens = result["batch"] * result["new_tokens"]
    for side in result["sides"].values():
        assert side["tokens"] == tokens and len(side["reps_s"]) == 3 and 0 < side["of_limit"] < 1
    assert result["bandwidth"]["gbs"] > 0


@SMOKE
def test_async_rl_runs_staleness_0_1_and_2_for_as_many_steps(smoke) -> None:
    rows = smoke[0]["results"]["async_rl"]["rows"]
    assert [row["staleness"] for row in rows] == [0, 1, 2]
    assert len({row["steps"] for row in rows}) == 1 and all(row["steps_per_hour"] > 0 for row in rows)


@SMOKE
def test_sft_and_update_memory_put_their_peer_beside_trajlab(smoke) -> None:
    results = smoke[0]["results"]
    assert list(results["sft"]["sides"])[0] == "trl" and "trajlab" in results["sft"]["sides"]
    assert all(side["tokens_per_s"] > 0 for side in results["sft"]["sides"].values())
    lengths = results["update_memory"]["lengths"]
    assert list(lengths) == [str(n) for n in smoke[0]["scale"]["update_tokens"]]
    assert all(set(frameworks) == {"trajlab", "trl"} for frameworks in lengths.values())
