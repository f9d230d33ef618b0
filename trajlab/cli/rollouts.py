"""``trajlab collect`` and ``trajlab eval``: roll a policy out on an env, keep the trajectories, score them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from trajlab.cli.common import ConfigFile, ConfigOption, Sets, config_options, console, load, usage_error
from trajlab.cli.output import progress

EnvOption = Annotated[str | None, typer.Option(
    help="Registered env name or import path 'my_pkg.envs:MyEnv'; several comma-separated names mix envs (tasks "
         "carry an 'env' column). Default: the config's env.")]
POLICY_HELP = ("'oracle' (the env's reference policy), a model directory, or an OpenAI-compatible server's URL "
               "http://host:port/v1\\[#model] (needs --tokenizer).")
PolicyOption = Annotated[str, typer.Option(help=POLICY_HELP)]
TasksFile = Annotated[Path | None, typer.Option(help="JSONL file of tasks instead of the env's generator.")]
Tokenizer = Annotated[str | None, typer.Option(
    help="Tokenizer of the oracle policy (default: the tiny model, or the tiny vision-language model for an env whose "
    "tools return images), or, required, the served model's for a server --policy.")]
ROLLOUT_OPTIONS: tuple[ConfigOption, ...] = (
    "rollout.parser", "rollout.concurrency", "rollout.max_turns", "rollout.max_episode_tokens",
    "rollout.max_new_tokens", ("rollout.tool_timeout_s", "--tool-timeout"), "rollout.system_prompt",
    "rollout.prompt_file")
"""How episodes roll out: every command that rolls a policy out takes them."""
PLACEMENT_OPTIONS: tuple[ConfigOption, ...] = ("model.device", "model.dtype", "model.backend")
"""Where a model runs and what generates for it."""


@config_options("collect.episodes", "collect.split", "collect.samples_per_task", "collect.temperature",
                "collect.reference", "collect.reference_noise", ("seed", "--seed"), *ROLLOUT_OPTIONS,
                *PLACEMENT_OPTIONS)
def collect_command(
    policy: PolicyOption,
    out: Annotated[Path, typer.Option(help="Trajectory file (JSONL); appended to, and resumed if it exists.")],
    env: EnvOption = None,
    tasks: TasksFile = None,
    tokenizer: Tokenizer = None,
    config: ConfigFile = None,
    sets: Sets = None,
    *,
    given: dict[str, Any],
) -> None:
    """Roll out a policy on an env and append the trajectories to OUT, then print a summary."""
    import trajlab
    from trajlab.evaluation import evaluate_trajectories

    settings = load(config, sets, {"env": env, **given})
    already: list[int] = []  # the first progress report says how many episodes were on disk

    with progress("collect") as show:
        def on_progress(done: int, total: int) -> None:
            if not already:
                already.append(done)
            show(done, total)

        trajectories = trajlab.collect(settings.env_spec(), policy, out=out, tasks=tasks, tokenizer=tokenizer,
                                       seed=settings.seed, rollout=settings.rollout, on_progress=on_progress,
                                       device=settings.model.device, dtype=settings.model.dtype,
                                       backend=settings.model.backend, vllm=settings.model.vllm,
                                       **settings.collect.model_dump())
    report = evaluate_trajectories(trajectories)
    table = Table(title=f"{out}", show_header=False)
    table.add_row("episodes", str(report.episodes))
    if already and already[0]:
        table.add_row("already on disk", str(already[0]))
    table.add_row("success rate", f"{report.success_rate:.3f}")
    table.add_row("mean reward", f"{report.mean_reward:.3f}")
    table.add_row("mean turns", f"{report.mean_turns:.2f}")
    table.add_row("tool-error rate", f"{report.tool_error_rate:.3f}")
    table.add_row("parse-error rate", f"{report.parse_error_rate:.3f}")
    table.add_row("statuses", ", ".join(f"{k} {v}" for k, v in report.statuses.items() if v))
    console.print(table)


eval_app = typer.Typer(
    help="Evaluate a policy on held-out tasks (success rate, pass@k, per-task table), or compare two evaluations.",
    invoke_without_command=True,
    no_args_is_help=True,
)


@eval_app.callback()
@config_options("eval.num_tasks", "eval.samples_per_task", ("eval.ks", "--k"), "eval.split", "eval.seed",
                "eval.temperature", *ROLLOUT_OPTIONS, *PLACEMENT_OPTIONS, "report_to")
def eval_command(
    ctx: typer.Context,
    env: EnvOption = None,
    policy: Annotated[str | None, typer.Option(help=POLICY_HELP)] = None,
    out: Annotated[Path | None, typer.Option(help="Run dir for trajectories.jsonl + eval.json; resumed.")] = None,
    label: Annotated[str | None, typer.Option(help="Run name in tables (default: the policy's name).")] = None,
    tasks: TasksFile = None,
    tokenizer: Tokenizer = None,
    max_tasks: Annotated[int, typer.Option(min=0, help="Task rows to print (weakest first).")] = 20,
    config: ConfigFile = None,
    sets: Sets = None,
    *,
    given: dict[str, Any],
) -> None:
    """Roll out POLICY on SPLIT with --samples-per-task episodes per task, write OUT/eval.json, print the tables.

    `trajlab eval compare A.json B.json` compares two saved evaluations instead.
    """
    if ctx.invoked_subcommand is not None:
        return  # `trajlab eval compare ...`: this callback only runs an evaluation when no subcommand is given
    import trajlab
    from trajlab.evaluation import report_table

    missing = [f"--{name}" for name, value in (("policy", policy), ("out", out)) if value is None]
    if missing:
        raise usage_error(f"trajlab eval needs {', '.join(missing)} (or: trajlab eval compare A.json B.json).")
    if tasks is not None and given["eval.num_tasks"] is None:
        from trajlab.env.registry import read_tasks_file

        given["eval.num_tasks"] = max(len(read_tasks_file(tasks)), 1)
    settings = load(config, sets, {"env": env, **given})
    with progress("eval") as on_progress:
        report = trajlab.evaluate(settings.env_spec(), policy, out=out, tasks=tasks, tokenizer=tokenizer,
                                  rollout=settings.rollout, label=label, on_progress=on_progress,
                                  device=settings.model.device, dtype=settings.model.dtype,
                                  backend=settings.model.backend, vllm=settings.model.vllm,
                                  report_to=settings.report_to, **settings.eval.model_dump())
    console.print(report_table(report, max_tasks=max_tasks))
    console.print(f"Wrote {out / 'trajectories.jsonl'} and {out / 'eval.json'}")


@eval_app.command("compare")
def eval_compare(
    a: Annotated[Path, typer.Argument(help="The baseline eval.json.")],
    b: Annotated[Path, typer.Argument(help="The eval.json to compare with it (deltas are B - A).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON instead of a table.")] = False,
    max_tasks: Annotated[int, typer.Option(min=0, help="Changed tasks to print (largest change first).")] = 20,
) -> None:
    """Compare two evaluations: every metric with its delta, and the tasks whose success changed."""
    from trajlab.evaluation import compare_reports, comparison_table, load_report

    report_a, report_b = load_report(a), load_report(b)
    if report_a.label == report_b.label:  # two runs of one policy: name the columns by file instead
        report_a = report_a.model_copy(update={"label": str(a)})
        report_b = report_b.model_copy(update={"label": str(b)})
    comparison = compare_reports(report_a, report_b)
    if as_json:
        typer.echo(json.dumps(comparison, indent=2))
        return
    console.print(comparison_table(comparison, max_tasks=max_tasks))
