"""Dependencies: every import is declared, the core runs without the optional extras, and a missing extra is one line.

The optional packages are hidden from a subprocess by a ``None`` entry in ``sys.modules`` (importing it then raises
``ImportError``, and ``importlib.util.find_spec`` reports it absent, as transformers and TRL check it), so these
tests run in the full test environment.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import trajlab

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"serve": ["fastapi", "starlette", "uvicorn", "httpx2"], "evolve": ["gepa"], "lora": ["peft"],
          "ray": ["ray"], "vllm": ["vllm"], "tensorboard": ["tensorboard"], "wandb": ["wandb"],
          "trackio": ["trackio"], "mlflow": ["mlflow"], "browser": ["selenium"], "vision": ["PIL"],
          "harmony": ["openai_harmony"], "docs": ["mkdocs"], "mcp": ["mcp"]}
# Extras not in the `test` extra, each with the reason.
LANE_EXTRAS = {
    "vllm": "scripts/test.sh --vllm runs tests/vllm in .venv-vllm (scripts/setup_vllm.sh): it pins its own torch",
    "wandb": "accelerate's tracker; the tests check only the missing-package message (tests/train/test_tracking.py)",
    "trackio": "likewise; trackio pulls in gradio",
    "mlflow": "likewise; mlflow pulls in a web server and a database layer",
}
# Hidden to stand for "not installed"; httpx2 stays: the core's openai client imports it (openai >= 3).
OPTIONAL = sorted(name for names in EXTRAS.values() for name in names if name != "httpx2")
# Imported, yet rightly not declared: each comes with a declared package, or cannot be declared.
UNDECLARED = {
    "starlette": "fastapi's own foundation (serve extra)",
    "safetensors": "transformers requires it (tests only)",
    "bfcl_eval": "pulls ~150 packages: scripts/setup.sh installs it with --no-deps",
}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """Distribution names per group of pyproject.toml: "core" and each extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {group: {_normalise(re.match(r"[A-Za-z0-9._-]+", spec)[0]) for spec in specs}
            for group, specs in groups.items()}


def _third_party_imports(folder: Path) -> dict[str, str]:
    """Top-level module names imported anywhere under ``folder`` that are neither stdlib nor local, with a file.

    A module of the folder's own scripts (``benchmarks/_seeds.py``, which the scripts run from that folder import, and
    ``benchmarks/rl_memory.py``, which ``benchmarks/gpu`` imports through its path) is local."""
    found: dict[str, str] = {}
    scripts = {path.stem for path in folder.rglob("*.py")}
    local = {"trajlab", "tests", "benchmarks", "examples", *scripts}  # examples: the tests import the examples' code
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("folder", ["trajlab", "tests", "benchmarks"])
def test_every_imported_package_is_declared(folder):
    declared = _declared()
    allowed = set().union(*(names for group, names in declared.items() if group != "test" or folder != "trajlab"))
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in _third_party_imports(ROOT / folder).items():
        if module in UNDECLARED:
            continue
        names = {_normalise(d) for d in distributions.get(module, [module])}
        if not names & allowed:
            missing[module] = where
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_test_extra_holds_every_feature_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    features = [group for group in project["optional-dependencies"] if group != "test"]
    assert sorted(features) == sorted(EXTRAS)
    in_test = [extra for extra in EXTRAS if extra not in LANE_EXTRAS]
    assert f"trajlab[{','.join(in_test)}]" in project["optional-dependencies"]["test"]


def test_optional_packages_are_in_their_extra_not_in_the_core():
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()  # PIL is the module of the pillow distribution
    for extra, modules in EXTRAS.items():
        for module in set(modules) - set(UNDECLARED):
            names = {_normalise(d) for d in distributions.get(module, [module])}
            assert names & (declared[extra] - declared["core"]), (extra, module)


def _run_without(code: str, hidden: list[str] = OPTIONAL) -> subprocess.CompletedProcess:
    hide = f"import sys\nfor name in {hidden!r}:\n    sys.modules[name] = None\n"
    return subprocess.run([sys.executable, "-c", hide + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_core_modules_import_without_the_extras():
    feature_modules = ("trajlab.proxy", "trajlab.evolution.search", "trajlab.evolution.adapter",
                       "trajlab.env.builtin.bfcl", "trajlab.env.builtin.odd_one_out",
                       "trajlab.inference.vllm_weight_engine")  # imported by vLLM's processes only
    modules = [m.name for m in pkgutil.walk_packages(trajlab.__path__, "trajlab.")
               if not m.name.startswith(feature_modules) and not m.name.endswith("__main__")]  # a script, run
    assert "trajlab.cli" in modules and "trajlab.train.rl" in modules and "trajlab.recipes.pipeline" in modules
    result = _run_without(f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
                          f"print(sorted(n for n in {OPTIONAL!r} if sys.modules.get(n) is not None))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_cli_starts_without_the_heavy_libraries():
    """torch, transformers, datasets and openai (4 s of imports on a laptop CPU) load where a command uses them, so
    `trajlab --help`, a usage error or `config show` starts in well under a second."""
    heavy = ["torch", "transformers", "datasets", "openai"]
    result = subprocess.run([sys.executable, "-c", f"import sys\nimport trajlab.cli\n"
                             f"print(sorted(n for n in {heavy!r} if n in sys.modules))"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _cli_without(args: list[str], hidden: list[str] = OPTIONAL) -> subprocess.CompletedProcess:
    return _run_without(f"from trajlab.cli import app\nsys.argv = ['trajlab', *{args!r}]\napp()", hidden)


def _one_line(result: subprocess.CompletedProcess, install: str) -> str:
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and install in lines[0], (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_serve_without_the_serve_extra_says_what_to_install(tmp_path):
    result = _cli_without(["serve", "--model", str(tmp_path)])
    assert result.returncode == 1
    assert "uvicorn" in _one_line(result, "pip install 'trajlab[serve]'")
    result = _cli_without(["traces", "export", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "t.jsonl")],
                          hidden=["fastapi"])
    assert result.returncode == 1
    assert "fastapi" in _one_line(result, "pip install 'trajlab[serve]'")


def test_evolve_without_the_evolve_extra_says_what_to_install(tmp_path):
    result = _cli_without(["evolve", "--env", "arithmetic", "--policy", "oracle", "--out", str(tmp_path)])
    assert result.returncode != 0
    assert "gepa" in _one_line(result, "pip install 'trajlab[evolve]'")
    assert not (tmp_path / "gepa").exists()


def test_rollout_workers_without_ray_say_what_to_install(tmp_path):
    result = _cli_without(["collect", "--env", "arithmetic", "--policy", "oracle", "--episodes", "1", "--out",
                           str(tmp_path / "t.jsonl"), "--set", "rollout.workers=2"])
    assert result.returncode == 1
    assert "rollout.workers needs the 'ray' package" in _one_line(result, "pip install 'trajlab[ray]'")
    assert not (tmp_path / "t.jsonl").exists()


def test_model_init_vision_without_pillow_says_what_to_install(tmp_path):
    result = _cli_without(["model", "init", "--vision", str(tmp_path / "vl")])
    assert result.returncode == 1
    line = _one_line(result, "pip install 'trajlab[vision]'")
    assert "the tiny vision-language model needs the 'PIL' package" in line
    assert not (tmp_path / "vl").exists()


def test_lora_without_peft_says_what_to_install():
    result = _run_without("from trajlab.config import LoraSettings\nfrom trajlab.train.lora import lora_config\n"
                          "lora_config(LoraSettings())")
    assert "MissingDependency: LoRA (--lora-r, lora: settings) needs the 'peft' package" in result.stderr
    assert "pip install 'trajlab[lora]'" in result.stderr


def test_a_run_needing_an_extra_fails_before_its_first_stage(tmp_path):
    result = _cli_without(["run", "configs/evolve.yaml", "--run-dir", str(tmp_path)])  # eval -> evolve -> eval
    assert result.returncode != 0
    assert "the evolve stage needs the 'gepa' package" in _one_line(result, "pip install 'trajlab[evolve]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no model built, no eval run


def test_the_vllm_backend_without_vllm_says_what_to_install(tiny_model_dir, tmp_path):
    args = ["collect", "--env", "arithmetic", "--policy", str(tiny_model_dir), "--episodes", "1", "--out",
            str(tmp_path / "t.jsonl"), "--backend"]
    result = _cli_without([*args, "vllm"])
    assert result.returncode == 1
    assert "the vllm backend (model.backend: vllm) needs the 'vllm' package" in _one_line(
        result, "pip install 'trajlab[vllm]'")
    result = _cli_without([*args, "vlm"])
    assert result.returncode == 1
    assert "model.backend: Input should be 'hf' or 'vllm'" in _one_line(result, "model.backend")
    assert not (tmp_path / "t.jsonl").exists()
