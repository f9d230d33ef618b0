"""User mistakes on the command line: one line that says what was wrong and how to fix it, exit 1; usage errors 2.

Each case is a real invocation against real files (a missing one, a broken one), a real tiny model and a loopback
port nothing listens on. None may print a traceback.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from trajlab.cli import app

runner = CliRunner()

OUT = ["--out", "{T}/out.jsonl"]
ORACLE = ["--env", "arithmetic", "--policy", "oracle", *OUT]

MISTAKES = {  # what the user typed -> a fragment of the one line they must see
    "unknown env": (["collect", "--env", "nosuch", "--policy", "oracle", *OUT],
                    "Unknown environment 'nosuch'. Registered: arithmetic"),
    "misspelled env": (["collect", "--env", "arithmetc", "--policy", "oracle", *OUT], "Did you mean 'arithmetic'?"),
    "env import path": (["collect", "--env", "my_pkg.envs:Nope", "--policy", "oracle", *OUT],
                        "No module named 'my_pkg'. An import path names a module importable here"),
    "no env": (["collect", "--policy", "oracle", *OUT], "no env: give --env"),
    "missing model directory": (["collect", "--env", "arithmetic", "--policy", "{T}/no-model", *OUT],
                                "a Hugging Face model name or a server URL (http://host:port/v1[#model]): cannot "
                                "load the policy: '{T}/no-model' does not exist"),
    "missing tasks file": (["collect", *ORACLE, "--tasks", "{T}/missing.jsonl"],
                           "{T}/missing.jsonl: no such tasks file"),
    "unreadable tasks": (["collect", *ORACLE, "--tasks", "{T}/bad_tasks.jsonl"],
                         "{T}/bad_tasks.jsonl:2: not valid JSON"),
    "unreachable server": (["collect", "--env", "arithmetic", "--policy", "http://127.0.0.1:{PORT}/v1",
                            "--tokenizer", "{M}", *OUT], "cannot reach an OpenAI-compatible server"),
    "server without tokenizer": (["collect", "--env", "arithmetic", "--policy", "http://127.0.0.1:{PORT}/v1", *OUT],
                                 "pass --tokenizer with the served model's directory"),
    "missing config": (["collect", *ORACLE, "--config", "{T}/missing.yaml"], "{T}/missing.yaml: no such config file"),
    "bad --set value": (["collect", *ORACLE, "--set", "rollout.max_turns=abc"],
                        "rollout.max_turns: Input should be a valid integer"),
    "misspelled --set section": (["collect", *ORACLE, "--set", "rolout.max_turns=3"],
                                 "rolout: unknown key (did you mean 'rollout'?)"),
    "bad YAML": (["run", "{T}/broken.yaml"],
                 "{T}/broken.yaml: not valid YAML: expected ',' or ']', but got ':' at line 2"),
    "misspelled section": (["run", "{T}/misspelled.yaml"], "rolout: unknown key (did you mean 'rollout'?)"),
    "misspelled key": (["run", "{T}/badkey.yaml"], "rollout.max_turnz: unknown key (did you mean 'max_turns'?)"),
    "config show of a bad config": (["config", "show", "{T}/misspelled.yaml"],
                                    "rolout: unknown key (did you mean 'rollout'?)"),
    "sft from a missing file": (["sft", "--model", "{M}", "--from", "{T}/missing.jsonl", "--out", "{T}/sft"],
                                "{T}/missing.jsonl: no such trajectory file"),
    "sft on a missing model": (["sft", "--model", "{T}/no-model", "--data", "{T}/ds", "--out", "{T}/sft"],
                               "cannot load model: '{T}/no-model' does not exist"),
    "rl on a missing model": (["rl", "--env", "arithmetic", "--model", "{T}/no-model", "--out", "{T}/rl"],
                              "cannot load model: '{T}/no-model' does not exist"),
    "dataset from a missing file": (["dataset", "--kind", "sft", "--from", "{T}/missing.jsonl", "--out", "{T}/d.jsonl"],
                                    "{T}/missing.jsonl: no such trajectory file"),
    "dataset from a file that is not trajectories": (
        ["dataset", "--kind", "sft", "--from", "{T}/notraj.jsonl", "--out", "{T}/d.jsonl"], "{T}/notraj.jsonl:1"),
    "dataset from an empty file": (["dataset", "--kind", "sft", "--from", "{T}/empty.jsonl", "--out", "{T}/d.jsonl"],
                                   "no trajectories in {T}/empty.jsonl"),
    "collect into a file that is not trajectories": (["collect", *ORACLE[:-2], "--out", "{T}/notes.txt"],
                                                      "{T}/notes.txt:1: not a trajectory line"),
    "compare a missing report": (["eval", "compare", "{T}/missing.json", "{T}/notreport.json"],
                                 "no such eval report (write one with `trajlab eval`)"),
    "compare a file that is no report": (["eval", "compare", "{T}/notreport.json", "{T}/notreport.json"],
                                         "{T}/notreport.json: not a valid eval report"),
    "pass@k beyond the samples": (["eval", "--env", "arithmetic", "--policy", "oracle", "--out", "{T}/ev",
                                   "--k", "5"], "pass@5 needs samples_per_task >= 5; got 1"),
    "export with a missing tokenizer": (["traces", "export", "--tokenizer", "{T}/no-model", *OUT],
                                        "'{T}/no-model' does not exist"),
    "serve a missing model": (["serve", "--model", "{T}/no-model"], "'{T}/no-model' does not exist"),
    "misspelled serve key": (["serve", "--config", "{T}/serve_typo.yaml"],
                             "serve.max_body_byte: unknown key (did you mean 'max_body_bytes'?)"),
    "serve an upstream that is no URL": (["serve", "--set", "serve.upstream=127.0.0.1:8001"],
                                         "--upstream (serve.upstream) must be an http(s) URL"),
    "serve a context the model has not": (["serve", "--model", "{M}", "--max-context", "100000"],
                                          "serve.max_context 100000 is longer than the model's context of 32768"),
    "model init over files": (["model", "init", "{T}"], "already exists and is not empty; replace it with --overwrite"),
    "task row without a field": (["collect", *ORACLE, "--tasks", "{T}/short_task.jsonl"],
                                 "{T}/short_task.jsonl:2: not a valid arithmetic task: missing field 'answer'"),
    "task row with a mistyped field": (["collect", *ORACLE, "--tasks", "{T}/typed_task.jsonl"],
                                       "{T}/typed_task.jsonl:1: not a valid arithmetic task: "
                                       "field 'a' is a string ('7')"),
    "export a missing record dir": (["traces", "export", "--tokenizer", "{M}", "--record-dir", "{T}/no-sessions",
                                     *OUT], "{T}/no-sessions: no such record directory"),
    "evolve with the oracle": (["evolve", "--env", "arithmetic", "--policy", "oracle", "--out", "{T}/evo"],
                               "The oracle cannot reflect: give a reflection LM"),
    "unclosed --set list": (["collect", *ORACLE, "--set", "rl.steps=[1"],
                            "--set rl.steps=[1: the value is not valid YAML: expected ',' or ']', but got "
                            "'<stream end>' at line 1, column 3"),
    "duplicate YAML key": (["config", "show", "{T}/duplicate.yaml"],
                           "{T}/duplicate.yaml: not valid YAML: found duplicate key 'max_turns' (first at line 3) "
                           "at line 4, column 3"),
    "config that is a FIFO": (["collect", *ORACLE, "--config", "{T}/fifo"],
                              "{T}/fifo: not a regular file (a FIFO); give a config file (YAML)"),
    "collect into a device": (["collect", *ORACLE[:-2], "--out", "/dev/full"],
                              "/dev/full: not a regular file (a character device); give the path of a trajectory "
                              "file (JSONL)"),
    "collect into a FIFO": (["collect", *ORACLE[:-2], "--out", "{T}/fifo"], "{T}/fifo: not a regular file (a FIFO)"),
    "tasks from a device": (["collect", *ORACLE, "--tasks", "/dev/zero"],
                            "/dev/zero: not a regular file (a character device); give a tasks file (JSONL)"),
    "prompt file that is a FIFO": (["collect", *ORACLE, "--prompt-file", "{T}/fifo"],
                                   "{T}/fifo: not a regular file (a FIFO); give a prompt file"),
    "dataset from a FIFO": (["dataset", "--kind", "sft", "--from", "{T}/fifo", "--out", "{T}/d.jsonl"],
                            "{T}/fifo: not a regular file (a FIFO); give a trajectory file (JSONL, as `trajlab "
                            "collect` writes)"),
    "dataset from a directory": (["dataset", "--kind", "sft", "--from", "{T}", "--out", "{T}/d.jsonl"],
                                 "{T}: not a regular file (a directory); give a trajectory file"),
    "report of a FIFO": (["report", "{T}/fifo"], "{T}/fifo: not a regular file (a FIFO); give a trajectory file"),
    "compare a report that is a device": (["eval", "compare", "/dev/zero", "/dev/zero"],
                                          "/dev/zero: not a regular file (a character device); give an eval report"),
    "task row of an unknown kind": (["collect", "--env", "ctf", "--policy", "oracle", *OUT, "--tasks",
                                     "{T}/ctf_kind.jsonl"],
                                    "{T}/ctf_kind.jsonl:1: not a valid ctf task: field 'kind' is 'nosuch', not one of "
                                    "'encoding', 'hidden', 'cipher', 'service'"),
    "arithmetic task of an unknown operation": (["collect", *ORACLE, "--tasks", "{T}/ops_task.jsonl"],
                                                "{T}/ops_task.jsonl:1: not a valid arithmetic task: field 'ops' holds "
                                                "'divide', not one of 'add', 'subtract', 'multiply'"),
    "arithmetic task with an operation too many": (["collect", *ORACLE, "--tasks", "{T}/long_task.jsonl"],
                                                   "{T}/long_task.jsonl:1: not a valid arithmetic task: "
                                                   "3 operations need operand field 'd'"),
    "bfcl task of an unknown entry": (["collect", "--env", "bfcl", "--policy", "oracle", *OUT, "--tasks",
                                       "{T}/bfcl_task.jsonl"],
                                      "{T}/bfcl_task.jsonl:1: not a valid bfcl task: 'multi_turn_base_999': "
                                      "category 'base' has entries 0 to 199"),
}

USAGE = {  # a wrong combination or form of options: exit 2
    "unknown option": (["collect", *ORACLE, "--nope"], "No such option: --nope"),
    "out of range": (["collect", *ORACLE, "--episodes", "0"], "Invalid value for '--episodes'"),
    "--set without =": (["collect", *ORACLE, "--set", "rollout.max_turns"], "--set takes KEY=VALUE"),
    "serve two models": (["serve", "--model", "{M}", "--upstream", "http://127.0.0.1:{PORT}/v1"],
                         "--upstream forwards to a server that serves its own model"),
    "sft without a model": (["sft", "--from", "{T}/notraj.jsonl", "--out", "{T}/sft"], "give --model DIR"),
    "serve a model and the config's upstream": (["serve", "--model", "{M}", "--config", "{T}/upstream.yaml"],
                                                "forwards to a server that serves its own model (serve.upstream)"),
    "sft-only dataset option for rl": (["dataset", "--kind", "rl", "--from", "{T}/notraj.jsonl", "--out", "{T}/d.jsonl",
                                        "--max-tokens", "10"], "apply to --kind sft only"),
}


@pytest.fixture
def where(tmp_path, tiny_model_dir):
    """The placeholders: a folder of broken inputs, the tiny model, and a loopback port nothing listens on."""
    (tmp_path / "bad_tasks.jsonl").write_text('{"question": "1+1", "answer": 2}\nnot json\n')
    (tmp_path / "misspelled.yaml").write_text("env: arithmetic\nrolout:\n  max_turns: 3\n")
    (tmp_path / "badkey.yaml").write_text("env: arithmetic\nrollout:\n  max_turnz: 3\n")
    (tmp_path / "broken.yaml").write_text("env: [arithmetic\nrollout: {\n")
    (tmp_path / "serve_typo.yaml").write_text("serve:\n  port: 8123\n  max_body_byte: 1000\n")
    (tmp_path / "upstream.yaml").write_text("serve:\n  upstream: http://127.0.0.1:8001/v1\n")
    (tmp_path / "notreport.json").write_text("{}")
    (tmp_path / "notraj.jsonl").write_text("garbage\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("notes without a newline at the end")
    task = {"question": "Compute (7 - 7) * 1.", "a": 7, "b": 7, "c": 1, "ops": ["subtract", "multiply"], "answer": 0}
    short = {k: v for k, v in task.items() if k != "answer"}
    (tmp_path / "short_task.jsonl").write_text(json.dumps(task) + "\n" + json.dumps(short) + "\n")
    (tmp_path / "typed_task.jsonl").write_text(json.dumps(task | {"a": "7"}) + "\n")
    (tmp_path / "ops_task.jsonl").write_text(json.dumps(task | {"ops": ["divide", "multiply"]}) + "\n")
    (tmp_path / "long_task.jsonl").write_text(json.dumps(task | {"ops": ["subtract", "multiply", "add"]}) + "\n")
    (tmp_path / "bfcl_task.jsonl").write_text(json.dumps({"task_id": "multi_turn_base_999", "category": "base"}) + "\n")
    (tmp_path / "ctf_kind.jsonl").write_text(json.dumps({"kind": "nosuch", "seed": 1}) + "\n")
    (tmp_path / "duplicate.yaml").write_text("env: arithmetic\nrollout:\n  max_turns: 3\n  max_turns: 4\n")
    os.mkfifo(tmp_path / "fifo")  # opened for reading, it blocks until a writer comes: none ever does
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {"{T}": str(tmp_path), "{M}": str(tiny_model_dir), "{PORT}": str(port)}


def fill(text: str, where: dict[str, str]) -> str:
    for placeholder, value in where.items():
        text = text.replace(placeholder, value)
    return text


def run(args: list[str], where: dict[str, str]) -> tuple[int, str]:
    result = runner.invoke(app, [fill(arg, where) for arg in args], env={"COLUMNS": "400"})
    output = result.stdout + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output, output
    return result.exit_code, output


def test_there_are_at_least_twenty_user_mistakes():
    assert len(MISTAKES) >= 20


@pytest.mark.parametrize("case", MISTAKES)
def test_a_user_mistake_is_one_line_with_exit_1(case, where):
    args, expected = MISTAKES[case]
    code, output = run(args, where)
    lines = output.strip().splitlines()
    assert code == 1, output
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert fill(expected, where) in lines[0]


@pytest.mark.parametrize("case", USAGE)
def test_a_usage_error_exits_2(case, where):
    args, expected = USAGE[case]
    code, output = run(args, where)
    assert code == 2, output
    assert fill(expected, where) in " ".join(output.replace("│", " ").split())


def test_the_trajlab_process_prints_no_traceback(where):
    """Through the real entry point in a process of its own: what a shell user sees."""
    args = [fill(arg, where) for arg in MISTAKES["missing tasks file"][0]]
    result = subprocess.run([sys.executable, "-m", "trajlab.cli", *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.strip().splitlines() == [f"error: {where['{T}']}/missing.jsonl: no such tasks file "
                                                  "(JSONL: one task object per line)"]


def test_a_set_that_is_not_utf8_is_one_line(where):
    """The shell hands Python the bytes of an argument; a value that is not UTF-8 is said, not a traceback."""
    args = [fill(arg, where) for arg in ORACLE] + [b"--set=rl.steps=\xff"]
    result = subprocess.run([sys.executable, "-m", "trajlab.cli", "collect", *args], capture_output=True,
                            timeout=120)
    assert result.returncode == 1 and b"Traceback" not in result.stderr, result.stderr.decode(errors="replace")
    assert result.stdout.decode().strip().splitlines() == [
        "error: --set rl.steps=\\xff: not UTF-8 text; give keys and values in UTF-8."]
