"""The layer contract in pyproject.toml ([tool.importlinter]): no module imports from a layer above its own.

The recipes are the top of the library (the CLI sits on them): nothing below imports a recipe. Before the contract
named the real layers, ``recipes/collect.py`` was a library that ``api.py`` and ``evolution/run.py`` imported from
below; the cases here put such an arrow back and see the contract break.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(("module", "line", "arrow"), [
    ("evolution/search.py", "from trajlab.recipes.collect import roll_out",
     "trajlab.evolution.search -> trajlab.recipes.collect"),  # evolution/run.py's arrow before the contract
    ("collection/plan.py", "from trajlab.recipes.arguments import as_env",
     "trajlab.collection.plan -> trajlab.recipes.arguments"),  # a library reaching into the recipes, as api.py did
    ("train/rl.py", "from trajlab.recipes import pipeline", "trajlab.train.rl -> trajlab.recipes.pipeline"),
    ("env/registry.py", "from trajlab.train import rl", "trajlab.env.registry -> trajlab.train.rl"),
    ("models/loading.py", "from trajlab.config import ModelSettings", "trajlab.models.loading -> trajlab.config"),
])
def test_an_import_from_a_layer_above_breaks_the_contract(tmp_path, module, line, arrow):
    shutil.copytree(ROOT / "trajlab", tmp_path / "trajlab", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "trajlab" / module
    target.write_text(target.read_text() + f"\n{line}  # a back-edge\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and arrow in result.stdout, result.stdout
