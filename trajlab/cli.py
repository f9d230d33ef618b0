"""The ``trajlab`` command line: a thin typer layer over the recipes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(help="Post-train LLMs to use tools across many turns.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
model_app = typer.Typer(help="Build and inspect models.", no_args_is_help=True)
app.add_typer(model_app, name="model")
console = Console()


def _fail(message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code=2)


@app.command()
def envs(as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False):
    """List the registered environments and their tools."""
    from trajlab.env.registry import load_env, registered_names

    rows = []
    for name in registered_names():
        spec = load_env(name)
        rows.append({"name": name, "description": spec.description, "tools": spec.tools})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table("env", "description", "tools")
    for row in rows:
        tools = "\n".join(
            f"{t['function']['name']}({', '.join(t['function']['parameters'].get('properties', {}))})"
            for t in row["tools"]
        )
        table.add_row(row["name"], row["description"], tools)
    console.print(table)


@model_app.command("init")
def model_init(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")],
    seed: Annotated[int, typer.Option(help="Weight initialisation seed.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing model directory.")] = False,
):
    """Build the tiny offline default model (Qwen3 architecture + byte-level BPE tokenizer) in seconds."""
    from trajlab.models import init_tiny_model, load_model

    started = time.perf_counter()
    try:
        path = init_tiny_model(out_dir, seed=seed, overwrite=overwrite)
    except (FileExistsError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    params = sum(p.numel() for p in load_model(path).parameters())
    elapsed = time.perf_counter() - started
    console.print(f"Wrote tiny model ({params / 1e6:.2f}M parameters) to {path} in {elapsed:.1f}s")


@app.command()
def collect(
    env: Annotated[str, typer.Option(help="Registered env name or import path 'my_pkg.envs:MyEnv'.")],
    policy: Annotated[str, typer.Option(help="'oracle' (the env's reference policy) or a model directory.")],
    episodes: Annotated[int, typer.Option(min=1, help="Number of episodes the output file should hold.")],
    out: Annotated[Path, typer.Option(help="Trajectory file (JSONL); appended to, and resumed if it exists.")],
    split: Annotated[str, typer.Option(help="Task split: train or test.")] = "train",
    seed: Annotated[int, typer.Option(help="Task order seed.")] = 0,
    samples_per_task: Annotated[int, typer.Option(min=1, help="Episodes per task (e.g. for pass@k).")] = 1,
    tasks: Annotated[Path | None, typer.Option(help="JSONL file of tasks instead of the env's generator.")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer for oracle demonstrations (default: tiny).")] = None,
    parser: Annotated[str, typer.Option(help="Tool-call parser: auto, hermes, llama3, response_template.")] = "auto",
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes run at once.")] = 8,
    max_turns: Annotated[int, typer.Option(min=1, help="Model turns per episode.")] = 8,
    max_episode_tokens: Annotated[int, typer.Option(min=1, help="Prompt + completion tokens per episode.")] = 2048,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per model turn.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature (0 = greedy).")] = 1.0,
    tool_timeout: Annotated[float, typer.Option(min=0.0, help="Seconds per tool call.")] = 10.0,
    system_prompt: Annotated[str | None, typer.Option(help="Replace the env's system prompt ('' for none).")] = None,
):
    """Roll out a policy on an env and append the trajectories to OUT, then print a summary."""
    from trajlab.collect import CollectConfig
    from trajlab.collect import collect as run_collect
    from trajlab.env.registry import load_env
    from trajlab.inference.base import SamplingParams
    from trajlab.rollout.engine import RolloutLimits

    try:
        config = CollectConfig(
            env=load_env(env), policy=policy, episodes=episodes, out=out, split=split, seed=seed,
            samples_per_task=samples_per_task, tasks_file=tasks, tokenizer=tokenizer, parser=parser,
            concurrency=concurrency, system_prompt=system_prompt,
            sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
            limits=RolloutLimits(max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                                 tool_timeout_s=tool_timeout),
        )
        if policy != "oracle" and not Path(policy).is_dir():
            raise ValueError(f"--policy must be 'oracle' or a model directory; {policy!r} is neither.")
        with Progress(TextColumn("collect"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            bar = progress.add_task("collect", total=episodes)
            summary = run_collect(config, on_progress=lambda done, total: progress.update(bar, completed=done))
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    _print_summary(summary, out)


def _print_summary(summary: dict, out: Path) -> None:
    table = Table(title=f"{out}", show_header=False)
    table.add_row("episodes", str(summary["episodes"]))
    if summary.get("resumed_from"):
        table.add_row("already on disk", str(summary["resumed_from"]))
    table.add_row("success rate", f"{summary['success_rate']:.3f}")
    table.add_row("mean reward", f"{summary['mean_reward']:.3f}")
    table.add_row("mean turns", f"{summary['mean_turns']:.2f}")
    table.add_row("tool-error rate", f"{summary['tool_error_rate']:.3f}")
    table.add_row("parse-error rate", f"{summary['parse_error_rate']:.3f}")
    table.add_row("statuses", ", ".join(f"{k} {v}" for k, v in summary["statuses"].items() if v))
    table.add_row("tokens/s", f"{summary['tokens_per_s']:.1f}")
    console.print(table)


if __name__ == "__main__":
    app()
