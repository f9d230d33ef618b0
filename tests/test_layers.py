"""The layer contract in pyproject.toml ([tool.importlinter]): no module imports from a layer above its own."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_its_layers():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_import_from_a_layer_above_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "trajlab", tmp_path / "trajlab", ignore=shutil.ignore_patterns("__pycache__"))
    env_module = tmp_path / "trajlab" / "env" / "registry.py"
    env_module.write_text(env_module.read_text() + "\nfrom trajlab.train import rl  # a back-edge\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "trajlab.env.registry -> trajlab.train.rl" in result.stdout
