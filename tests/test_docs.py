"""The user docs: the README front page and the MkDocs site under docs/.

The site builds with ``mkdocs build --strict`` (a broken link or anchor, a page left out of the nav or a docstring the
API pages cannot render fails it), and every shell command that the README and the docs show is either run by a test
named in ``TESTED`` below or marked ``<!-- not run: why -->`` on the line before its block.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = re.compile(r"^[ \t]*```(bash|console|sh|shell)[ \t]*\n(.*?)^[ \t]*```", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->\s*$")

# A documented command (a regular expression over the command with its whitespace collapsed) -> the file that runs
# it and words that file must contain, so an entry rots loudly when the test that ran it goes away.
TESTED: dict[str, tuple[str, tuple[str, ...]]] = {
    re.escape("mkdocs build --strict"): ("tests/test_docs.py", ('"build", "--strict"',)),
    # The generated env pages' command: every registered env collected by its oracle (4 episodes in the test).
    r"trajlab collect --env \w+ --policy oracle --episodes \d+ --out runs/\w+\.jsonl":
        ("tests/test_cli.py", ("test_collect_uses_the_envs_own_limits_by_default", '"--policy", "oracle"')),
    # docs/own-env.md: step 2 run here as shown (test_the_own_env_commands_run_as_shown) ...
    re.escape("""PYTHONPATH=. python -c "import trajlab; print(trajlab.check_env('examples.inventory.env:SPEC'))\""""):
        ("tests/test_docs.py", ("test_the_own_env_commands_run_as_shown",)),
    re.escape("PYTHONPATH=. trajlab collect --env examples.inventory.env:SPEC --policy oracle --episodes 20 "
              "--out runs/inv.jsonl"): ("tests/test_docs.py", ("test_the_own_env_commands_run_as_shown",)),
    # ... and step 4 with tiny budgets (the full run is benchmarks/env_learning.py's).
    re.escape("PYTHONPATH=. trajlab run examples/inventory/config.yaml"):
        ("tests/test_custom_env.py", ('"inventory" / "config.yaml"', '"run", str(CONFIG)')),
    # docs/mcp.md's whole example, with tiny budgets (--set) passed through run.sh to trajlab run.
    re.escape("bash examples/mcp_judge/run.sh"):
        ("tests/test_example_mcp_judge.py", ('"mcp_judge" / "run.sh"', '["bash", str(RUN_SH)')),
}


def shell_blocks() -> list[tuple[str, int, str | None, list[str]]]:
    """Every shell block of the README and docs: (page, line, the not-run reason or None, its commands)."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in SHELL.finditer(text):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            reason = NOT_RUN.search(before)
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((str(page.relative_to(ROOT)), line, reason and reason.group(1),
                           commands(match.group(2), console=match.group(1) == "console")))
    return blocks


def commands(body: str, console: bool) -> list[str]:
    """A block's commands: `$ ` lines of a console block (output lines are not commands), every line of a script;
    continuation lines joined, comments and extra whitespace dropped."""
    found, current = [], None
    for raw in body.splitlines():
        line = raw.strip()
        if current is None:
            if console and not line.startswith("$ "):
                continue
            line = line[2:] if console else line
            if not line or line.startswith("#"):
                continue
            current = ""
        current += " " + re.sub(r"\s+#\s.*$", "", line).removesuffix("\\")
        if not line.endswith("\\"):
            found.append(" ".join(current.split()))
            current = None
    return found


def is_tested(command: str) -> bool:
    return any(re.fullmatch(pattern, command) for pattern in TESTED)


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, env=env)


def test_the_site_builds_in_strict_mode(tmp_path):
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "Check an env the way trajlab will run it" in api, "the API pages are rendered from the docstrings"
    assert "fonts.googleapis.com" not in (tmp_path / "site" / "index.html").read_text(), "the build fetches nothing"


def test_a_broken_link_a_missing_anchor_or_a_page_left_out_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    config = (ROOT / "mkdocs.yml").read_text().replace("paths: [.]", f"paths: [{ROOT}]")
    (tmp_path / "mkdocs.yml").write_text(config)
    with (tmp_path / "docs" / "commands.md").open("a") as page:
        page.write("\nSee [nowhere](no-such-page.md) and [no heading](training.md#no-such-heading).\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n")
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    for named in ("no-such-page.md", "no-such-heading", "orphan.md"):
        assert named in output, (named, output)


def test_every_shown_command_is_run_by_a_test_or_marked_not_run():
    blocks = shell_blocks()
    assert len(blocks) > 10 and any(page == "README.md" for page, *_ in blocks)
    untested = [f"{page}:{line}: {command}" for page, line, reason, shown in blocks if reason is None
                for command in shown if not is_tested(command)]
    assert not untested, "run these in a test (and add them to TESTED) or mark their block <!-- not run: why -->:\n" \
        + "\n".join(untested)


def test_the_registry_names_tests_that_exist_and_hold_the_command():
    for pattern, (path, words) in TESTED.items():
        test_file = ROOT / path
        assert test_file.is_file(), f"{pattern}: {path} does not exist"
        text = test_file.read_text()
        missing = [word for word in words if word not in text]
        assert not missing, f"{pattern}: {path} no longer contains {missing}"
    shown = [command for *_, reason, found in shell_blocks() if reason is None for command in found]
    unused = [pattern for pattern in TESTED if not any(re.fullmatch(pattern, command) for command in shown)]
    assert not unused, f"entries no page shows any more: {unused}"


def test_the_registry_check_rejects_an_unregistered_command():
    assert commands("$ trajlab envs --json   # every env\n[...]\n$ a \\\n  b\n", console=True) == \
        ["trajlab envs --json", "a b"]
    assert is_tested("mkdocs build --strict") and not is_tested("mkdocs build --strict; rm -rf site")


def test_the_readme_is_a_front_page_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "## Two commands" in readme and "## Python API" in readme
    two = readme.split("## Two commands", 1)[1]
    first = SHELL.search(two).group(0)
    assert "bash scripts/quickstart.sh" in first and "bash scripts/test.sh" in first
    started = (ROOT / "docs" / "getting-started.md").read_text().split("## Two commands", 1)[1]
    assert SHELL.search(started).group(0) == first, "the README's two commands and getting-started.md's differ"
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def test_the_own_env_commands_run_as_shown(tmp_path):
    """docs/own-env.md's step 2, from the repository root as the page says, its output file moved to tmp_path."""
    block = next(body for kind, body in SHELL.findall((ROOT / "docs" / "own-env.md").read_text())
                 if "check_env" in body)
    check, collect = commands(block, console=True)
    shown_output = next(line.strip() for line in block.splitlines() if line.strip().startswith("EnvCheckReport("))
    env = os.environ | {"TRAJLAB_HOME": str(tmp_path),  # the oracle's default tokenizer is built there
                        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the venv's trajlab
    result = subprocess.run(check, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == shown_output
    out = tmp_path / "inv.jsonl"
    result = subprocess.run(collect.replace("runs/inv.jsonl", str(out)), shell=True, cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(out.read_text().splitlines()) == 20
