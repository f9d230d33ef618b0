"""A setting's default lives in its settings model only (``trajlab.config``): no function signature or dataclass
field elsewhere restates it. Code below the settings takes the validated model, or a required argument; the Python
API takes None for "the setting's default". A restated default drifts: ``concurrency`` once had five, of two values.
"""

import ast
import sys
from pathlib import Path

from pydantic import BaseModel

import trajlab
import trajlab.config

PACKAGE = Path(trajlab.__file__).resolve().parent
EXCEPTIONS: dict[str, str] = {
    "trajlab/inference/base.py:SamplingParams.temperature": "a generation request's temperature 1 is no warping at "
    "all (the model's own distribution), not a stage's setting: every stage passes its own temperature",
    "trajlab/rewards/judge.py:__init__(temperature)": "the LLM judge's own sampling, not a stage's: 0 grades the "
    "same conversation the same way, which its cache assumes",
}
"""``path:function(parameter)`` or ``path:Class.field`` allowed to keep a literal default, each with its reason."""


def settings_fields() -> dict[str, set[str]]:
    """Every field of every settings model that has a literal default, by name, with the models that hold it."""
    fields: dict[str, set[str]] = {}
    for model in vars(trajlab.config).values():
        if isinstance(model, type) and issubclass(model, BaseModel) and model.__module__.startswith("trajlab.config"):
            for name, field in model.model_fields.items():
                if isinstance(field.get_default(call_default_factory=True), str | int | float | bool):
                    fields.setdefault(name, set()).add(model.__name__)
    return fields


def restated(package: Path) -> dict[str, str]:
    """``path:function(parameter)`` (or ``path:Class.field``) -> the setting it restates, for every literal default
    of a parameter or class field named as a setting, outside the settings' own modules (``trajlab/config``)."""
    fields, found = settings_fields(), {}
    for path in sorted(package.rglob("*.py")):
        where = str(path.relative_to(package.parent))
        if where.startswith("trajlab/config"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for name, default, label in _defaults(node):
                literal = isinstance(default, ast.Constant) and default.value is not None
                if name in fields and literal and f"{where}:{label}" not in EXCEPTIONS:
                    found[f"{where}:{label}"] = f"{name} ({', '.join(sorted(fields[name]))})"
    return found


def _defaults(node: ast.AST) -> list[tuple[str, ast.expr, str]]:
    """(name, default, label) of each parameter with a default of a function, and each field of a class."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True))
        pairs += [(arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True) if default]
        return [(arg.arg, default, f"{node.name}({arg.arg})") for arg, default in pairs]
    if isinstance(node, ast.ClassDef):
        return [(item.target.id, item.value, f"{node.name}.{item.target.id}") for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None]
    return []


def test_no_default_of_a_setting_is_restated():
    found = restated(PACKAGE)
    assert not found, f"defaults restated outside the settings (take the settings model, or no default): {found}"


def test_a_restated_default_is_found(tmp_path, monkeypatch):
    package = tmp_path / "trajlab"
    (package / "rollout").mkdir(parents=True)
    (package / "rollout" / "runner.py").write_text(
        "from dataclasses import dataclass\n\n\n"
        "def run(episodes, *, concurrency=8, on_result=None):\n    pass\n\n\n"
        "def reflect(prompt, temperature=0.7):\n    pass\n\n\n"
        "@dataclass\nclass Plan:\n    device: str = 'auto'\n    name: str | None = None\n")
    monkeypatch.setattr(sys.modules[__name__], "EXCEPTIONS", {})
    assert restated(package) == {
        "trajlab/rollout/runner.py:run(concurrency)": "concurrency (RolloutSettings)",
        "trajlab/rollout/runner.py:reflect(temperature)":
            "temperature (CollectSettings, EvalSettings, EvolveSettings, RLSettings)",
        "trajlab/rollout/runner.py:Plan.device": "device (ModelSettings)",
    }
