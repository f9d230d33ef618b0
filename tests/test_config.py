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
