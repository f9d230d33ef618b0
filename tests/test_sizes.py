"""The readability budget (style guide, "A budget that holds"): no module in trajlab/ over 500 lines and no function
over 80, so a module reads in one sitting and a function on one screen. A breach names the offender."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trajlab"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
EXCEPTIONS: dict[str, str] = {}
"""``path`` or ``path:function`` over the budget, each with the reason it may be (none today)."""


def module_sizes() -> dict[str, int]:
    return {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
            for path in sorted(PACKAGE.rglob("*.py"))}


def function_sizes() -> dict[str, int]:
    """Every function and method by ``path:qualified.name``, with its lines from ``def`` (decorators included) to its
    last line: nested functions count toward the function that holds them, and are measured themselves too."""
    sizes: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        _measure(ast.parse(path.read_text()), f"{path.relative_to(PACKAGE.parent)}:", sizes)
    return sizes


def _measure(node: ast.AST, prefix: str, sizes: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([child.lineno, *(decorator.lineno for decorator in child.decorator_list)])
            sizes[f"{prefix}{child.name}"] = child.end_lineno - start + 1
            _measure(child, f"{prefix}{child.name}.", sizes)
        elif isinstance(child, ast.ClassDef):
            _measure(child, f"{prefix}{child.name}.", sizes)


def test_no_module_is_over_the_budget():
    over = {path: lines for path, lines in module_sizes().items()
            if lines > MAX_MODULE_LINES and path not in EXCEPTIONS}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): {over}"


def test_no_function_is_over_the_budget():
    over = {name: lines for name, lines in function_sizes().items()
            if lines > MAX_FUNCTION_LINES and name not in EXCEPTIONS}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {over}"


def test_the_budget_names_an_offender(tmp_path, monkeypatch):
    """A module and a function over the budget are each named, by path and qualified name."""
    package = tmp_path / "trajlab"
    package.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (package / "long.py").write_text(f"class Loop:\n    def step(self):\n{body}\n" + "\n" * MAX_MODULE_LINES)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert module_sizes()["trajlab/long.py"] > MAX_MODULE_LINES
    assert function_sizes()["trajlab/long.py:Loop.step"] == MAX_FUNCTION_LINES + 1
