from pathlib import Path

import pytest

from trajlab.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_config_validates_and_opens_with_its_command():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)
        assert path.read_text().startswith(f"# trajlab run configs/{path.name}")


def test_misspelled_key_is_an_error_naming_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env: arithmetic\nrl:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"rl\.stpes: unknown key \(did you mean 'steps'\?\)"):
        load_config(path)
    path.write_text("env: arithmetic\nsfft: {}\n")
    with pytest.raises(ConfigError, match=r"sfft: unknown key \(did you mean 'sft'\?\)"):
        load_config(path)


def test_bad_values_and_unknown_rewards_are_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env: arithmetic\nrl:\n  estimator: ppo\n  rewards: {env: 1, vibes: 1}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "rl.estimator" in str(info.value) and "vibes" in str(info.value)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env: arithmetic\nseed: 1\nrl: {steps: 3}\n")
    config = load_config(path, {"seed": 7, "rl": {"group_size": 4}})
    assert config.seed == 7 and config.rl.steps == 3 and config.rl.group_size == 4


def test_config_show_prints_yaml_that_run_accepts_back_unchanged(tmp_path):
    from typer.testing import CliRunner

    from trajlab.cli import app

    runner = CliRunner()

    def show(*args):
        result = runner.invoke(app, ["config", "show", *map(str, args)])
        assert result.exit_code == 0, result.stdout
        return result.stdout

    # the quickstart: every default written out, and the shown file shows the same again
    shown = show(ROOT / "configs" / "quickstart.yaml")
    (tmp_path / "quickstart.yaml").write_text(shown)
    assert "num_tasks:" in shown and "tool_timeout_s: null" in shown  # defaults included, env limits left to the env
    assert show(tmp_path / "quickstart.yaml") == shown
    assert load_config(tmp_path / "quickstart.yaml") == load_config(ROOT / "configs" / "quickstart.yaml")
    # a small run: `trajlab run` takes the shown file as it is, and records the very same configuration
    (tmp_path / "small.yaml").write_text("env: arithmetic\nstages: [eval]\nrollout: {max_turns: 2, max_new_tokens: 8}\n"
                                         "eval: {num_tasks: 2}\n")
    shown = show(tmp_path / "small.yaml", "--set", f"run_dir={tmp_path / 'run'}")
    (tmp_path / "shown.yaml").write_text(shown)
    result = runner.invoke(app, ["run", str(tmp_path / "shown.yaml")])
    assert result.exit_code == 0, result.stdout
    assert (tmp_path / "run" / "config.yaml").read_text() == shown
    assert (tmp_path / "run" / "eval-0-untrained" / "eval.json").is_file()


def test_model_device_and_dtype_are_validated():
    assert load_config(None, {"model": {"device": "cuda:1", "dtype": "bfloat16"}}).model.device == "cuda:1"
    assert load_config(None).model.model_dump(include={"device", "dtype"}) == {"device": "auto", "dtype": "auto"}
    with pytest.raises(ConfigError, match=r"model\.device: 'gpu' is not a device: use auto, cpu, cuda or cuda:N"):
        load_config(None, {"model": {"device": "gpu"}})
    with pytest.raises(ConfigError, match=r"model\.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"):
        load_config(None, {"model": {"dtype": "fp16"}})


def test_model_vllm_engine_arguments_are_validated():
    config = load_config(None, {"model": {"vllm": {"gpu_memory_utilization": 0.4, "max_model_len": 16384},
                                          "dtype": "bfloat16"}})
    assert config.model.engine_args() == {"gpu_memory_utilization": 0.4, "max_model_len": 16384,
                                          "enforce_eager": True, "dtype": "bfloat16"}
    assert load_config(None).model.engine_args() == {"enforce_eager": True}, "eager and the checkpoint's dtype"
    lockstep = load_config(None, {"model": {"vllm": {"batching": "lockstep"}}}).model
    assert lockstep.vllm.batching == "lockstep" and "batching" not in lockstep.engine_args(), "trajlab's, not vLLM's"
    assert load_config(None).model.vllm.batching == "continuous"
    with pytest.raises(ConfigError, match=r"model\.vllm\.batching: Input should be 'continuous' or 'lockstep'"):
        load_config(None, {"model": {"vllm": {"batching": "dynamic"}}})
    assert load_config(None, {"model": {"vllm": {"gpu_memory_utilization": 1}}}).model.vllm.gpu_memory_utilization == 1
    for share in (0, 1.5, -0.2):
        with pytest.raises(ConfigError, match=r"model\.vllm\.gpu_memory_utilization: Input should be (greater|less)"):
            load_config(None, {"model": {"vllm": {"gpu_memory_utilization": share}}})
    with pytest.raises(ConfigError, match=r"model\.vllm\.max_model_len: Input should be greater than or equal to 1"):
        load_config(None, {"model": {"vllm": {"max_model_len": 0}}})
    with pytest.raises(ConfigError, match=r"model\.vllm\.gpu_memory: unknown key \(did you mean "
                                          r"'gpu_memory_utilization'\?\)"):
        load_config(None, {"model": {"vllm": {"gpu_memory": 0.5}}})


def test_the_serve_section_is_shown_and_its_unknown_keys_are_errors(tmp_path):
    config = load_config(None, {"serve": {"port": 9000, "max_context": 2048}})
    assert (config.serve.port, config.serve.max_context, config.serve.max_body_bytes) == (9000, 2048, 4 << 20)
    path = tmp_path / "c.yaml"
    path.write_text("serve:\n  max_body_byte: 1000\n")
    with pytest.raises(ConfigError, match=r"serve\.max_body_byte: unknown key \(did you mean 'max_body_bytes'\?\)"):
        load_config(path)
    from typer.testing import CliRunner

    from trajlab.cli import app

    shown = CliRunner().invoke(app, ["config", "show", "--set", "serve.port=9000"]).stdout
    assert "\nserve:\n  host: 127.0.0.1\n  port: 9000\n" in shown and "  prefix_cache_mb: null\n" in shown
