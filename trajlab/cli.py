"""The ``trajlab`` command line: a thin typer layer over the recipes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from trajlab.errors import UserError, require
from trajlab.inference.base import is_server_url

if TYPE_CHECKING:
    from trajlab.collect import CollectConfig

app = typer.Typer(help="Post-train LLMs to use tools across many turns.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
model_app = typer.Typer(help="Build and inspect models.", no_args_is_help=True)
app.add_typer(model_app, name="model")
console = Console()


def _fail(message: str) -> typer.Exit:
    # messages quote user input: no markup in them; soft_wrap keeps one line however narrow the terminal
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code=2)


# Rollout options shared by `collect` and `eval`; each command sets its own defaults.
Split = Annotated[str, typer.Option(help="Task split: train or test (validation where the env has one, e.g. bfcl).")]
Seed = Annotated[int, typer.Option(help="Task order seed.")]
TasksFile = Annotated[Path | None, typer.Option(help="JSONL file of tasks instead of the env's generator.")]
OracleTokenizer = Annotated[str | None, typer.Option(
    help="Tokenizer of the oracle policy (default: tiny), or, required, the served model's for a server --policy.")]
PolicyHelp = ("'oracle' (the env's reference policy), a model directory, or an OpenAI-compatible server's URL "
              "http://host:port/v1[#model] (needs --tokenizer).")
Parser = Annotated[str, typer.Option(help="Tool-call parser: auto, hermes, llama3, response_template.")]
Concurrency = Annotated[int, typer.Option(min=1, help="Episodes run at once.")]
MaxTurns = Annotated[int, typer.Option(min=1, help="Model turns per episode.")]
MaxEpisodeTokens = Annotated[int, typer.Option(min=1, help="Prompt + completion tokens per episode.")]
MaxNewTokens = Annotated[int, typer.Option(min=1, help="Tokens per model turn.")]
Temperature = Annotated[float, typer.Option(min=0.0, help="Sampling temperature (0 = greedy).")]
ToolTimeout = Annotated[float, typer.Option(min=0.0, help="Seconds per tool call.")]
SystemPrompt = Annotated[str | None, typer.Option(help="Replace the env's system prompt ('' for none).")]
PromptFile = Annotated[Path | None, typer.Option(
    help="Roll out with evolved texts: trajlab evolve's result/best_candidate.json (system prompt and tool "
         "descriptions) or a text file holding the system prompt.")]


@app.command()
def envs(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
    docs: Annotated[Path | None, typer.Option(help="Write a Markdown page per env (tools from their schemas).")] = None,
):
    """List the registered environments and their tools."""
    from trajlab.env.registry import load_env, registered_names

    if docs is not None:
        from trajlab.env.docs import write_env_docs

        for page in write_env_docs(docs):
            typer.echo(page)
        return

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
    env: Annotated[str, typer.Option(help="Registered env name or import path 'my_pkg.envs:MyEnv'; several "
                                     "comma-separated names mix envs (tasks carry an 'env' column).")],
    policy: Annotated[str, typer.Option(help=PolicyHelp)],
    episodes: Annotated[int, typer.Option(min=1, help="Number of episodes the output file should hold.")],
    out: Annotated[Path, typer.Option(help="Trajectory file (JSONL); appended to, and resumed if it exists.")],
    split: Split = "train",
    seed: Seed = 0,
    samples_per_task: Annotated[int, typer.Option(min=1, help="Episodes per task (e.g. for pass@k).")] = 1,
    tasks: TasksFile = None,
    tokenizer: OracleTokenizer = None,
    parser: Parser = "auto",
    concurrency: Concurrency = 8,
    max_turns: MaxTurns = 8,
    max_episode_tokens: MaxEpisodeTokens = 2048,
    max_new_tokens: MaxNewTokens = 128,
    temperature: Temperature = 1.0,
    tool_timeout: ToolTimeout = 10.0,
    system_prompt: SystemPrompt = None,
    prompt_file: PromptFile = None,
):
    """Roll out a policy on an env and append the trajectories to OUT, then print a summary."""
    try:
        config = _collect_config(
            env, policy, episodes, out, split=split, seed=seed, samples_per_task=samples_per_task, tasks=tasks,
            tokenizer=tokenizer, parser=parser, concurrency=concurrency, max_turns=max_turns,
            max_episode_tokens=max_episode_tokens, max_new_tokens=max_new_tokens, temperature=temperature,
            tool_timeout=tool_timeout, system_prompt=system_prompt, prompt_file=prompt_file,
        )
        summary = _collect_with_progress(config, "collect")
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    _print_summary(summary, out)


def _collect_config(
    env: str, policy: str, episodes: int, out: Path, *, max_new_tokens: int, temperature: float, max_turns: int,
    max_episode_tokens: int, tool_timeout: float, tasks: Path | None, system_prompt: str | None,
    prompt_file: Path | None, **options,
) -> CollectConfig:
    """The CollectConfig behind `collect` and `eval`; ValueError names a bad option."""
    from trajlab.collect import CollectConfig
    from trajlab.env.mixture import load_envs
    from trajlab.evolve.candidate import prompted
    from trajlab.inference.base import SamplingParams
    from trajlab.rollout.engine import RolloutLimits

    _check_policy(policy)
    spec, system_prompt = prompted(load_envs(env), system_prompt, prompt_file)
    return CollectConfig(
        env=spec, policy=policy, episodes=episodes, out=out, tasks_file=tasks, system_prompt=system_prompt,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
        limits=RolloutLimits(max_turns=max_turns, max_episode_tokens=max_episode_tokens, tool_timeout_s=tool_timeout),
        **options,
    )


def _check_policy(policy: str) -> None:
    if policy != "oracle" and not is_server_url(policy) and not Path(policy).is_dir():
        raise ValueError(f"--policy must be 'oracle', a model directory or a server URL (http://host:port/v1[#model]);"
                         f" {policy!r} is none of these.")


def _policy_label(policy: str) -> str:
    """A policy's name in tables: oracle, a model directory's name, or a server's model (else its URL)."""
    if policy == "oracle":
        return policy
    if is_server_url(policy):
        return policy.partition("#")[2] or policy
    return Path(policy).name


def _collect_with_progress(config: CollectConfig, label: str) -> dict:
    """Run a collection under a progress bar; returns its summary."""
    from trajlab.collect import collect as run_collect

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        bar = progress.add_task(label, total=config.episodes)
        return run_collect(config, on_progress=lambda done, total: progress.update(bar, completed=done))


@app.command()
def dataset(
    kind: Annotated[Literal["sft", "rl", "preference"], typer.Option(
        help="sft: demonstrations; rl: the distinct tasks to roll out; preference: (success, failure) pairs for DPO.")],
    sources: Annotated[list[Path], typer.Option("--from", help="Trajectory file (JSONL); repeat to combine files.")],
    out: Annotated[Path, typer.Option(help="Output: FILE.jsonl, FILE.parquet, or a directory (save_to_disk).")],
    format: Annotated[Literal["disk", "jsonl", "parquet"] | None, typer.Option(
        "--format", help="Output format (default: from OUT's suffix).")] = None,
    include_failures: Annotated[bool, typer.Option(
        help="sft: keep failed and truncated episodes too, with a 'success' column.")] = False,
    shortest_per_task: Annotated[bool, typer.Option(help="sft: keep only the shortest success of each task.")] = False,
    max_tokens: Annotated[int | None, typer.Option(
        min=1, help="sft: drop trajectories longer than this many tokens (text-only ones are kept).")] = None,
):
    """Turn trajectory files into a Hugging Face dataset for SFT, RL or preference training."""
    from trajlab.data.datasets import preference_dataset, rl_dataset, save_dataset, sft_dataset
    from trajlab.data.store import StoreError, read_trajectories

    if kind != "sft" and (include_failures or shortest_per_task or max_tokens is not None):
        raise _fail("--include-failures, --shortest-per-task and --max-tokens apply to --kind sft only.")
    try:
        trajectories = [t for source in sources for t in read_trajectories(source)]
    except (OSError, StoreError) as exc:
        raise _fail(str(exc)) from exc
    if kind == "sft":
        built = sft_dataset(trajectories, include_failures=include_failures, shortest_per_task=shortest_per_task,
                            max_tokens=max_tokens)
    else:
        built = rl_dataset(trajectories) if kind == "rl" else preference_dataset(trajectories)
    path = save_dataset(built, out, format)
    console.print(f"Wrote {len(built)} {kind} rows from {len(trajectories)} trajectories to {path}")
    if kind == "preference" and len(built) == 0:
        console.print("[yellow]No task has both a success and a failure with the same prompt: nothing to pair.[/]")


def _section(config: Path | None, name: str, overrides: dict):
    """One config section from a YAML file (or defaults), with command-line overrides; unknown keys are errors."""
    import yaml
    from pydantic import ValidationError

    from trajlab.config import PipelineConfig

    data = {}
    if config is not None:
        loaded = yaml.safe_load(config.read_text()) or {}
        data = loaded.get(name, {}) if "env" in loaded else loaded
    data.update({k: v for k, v in overrides.items() if v is not None})
    model = PipelineConfig.model_fields[name].annotation
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _fail(f"invalid {name} settings: {exc}") from exc


@app.command()
def sft(
    model: Annotated[Path, typer.Option(help="Model directory to fine-tune.")],
    out: Annotated[Path, typer.Option(help="Output directory: checkpoints, then out/final.")],
    sources: Annotated[
        list[Path] | None, typer.Option("--from", help="Trajectory file(s); successes are used.")
    ] = None,
    data: Annotated[Path | None, typer.Option(help="A dataset written by `trajlab dataset --kind sft`.")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML with an `sft:` section (or a whole run config).")] = None,
    epochs: Annotated[float | None, typer.Option(help="Epochs over the data.")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many optimizer steps.")] = None,
    learning_rate: Annotated[float | None, typer.Option(help="Peak learning rate.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per step.")] = None,
    lora_r: Annotated[int | None, typer.Option(help="Train a LoRA adapter of this rank (merged at the end).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the newest checkpoint in OUT.")] = False,
    seed: Annotated[int, typer.Option(help="Training seed.")] = 0,
):
    """Supervised fine-tuning on trajectories, with loss on the model's own tokens only."""
    from trajlab.data.datasets import load_saved_dataset, sft_dataset
    from trajlab.data.store import read_trajectories
    from trajlab.models import load_tokenizer
    from trajlab.train.sft import run_sft

    if (sources is None) == (data is None):
        raise _fail("give exactly one of --from TRAJECTORIES.jsonl or --data DATASET.")
    settings = _section(config, "sft", {"epochs": epochs, "max_steps": max_steps, "learning_rate": learning_rate,
                                        "batch_size": batch_size, "lora": {"r": lora_r} if lora_r else None})
    built = sft_dataset([t for s in sources for t in read_trajectories(s)]) if sources else load_saved_dataset(data)
    final = run_sft(model, load_tokenizer(model), built, out, settings, seed=seed, resume=resume)
    console.print(f"SFT on {len(built)} rows done: {final}")


@app.command()
def rl(
    model: Annotated[Path, typer.Option(help="Model directory to train (e.g. the SFT result).")],
    env: Annotated[str, typer.Option(help="Registered env name or import path; comma-separated names mix envs.")],
    out: Annotated[Path, typer.Option(help="Output directory: metrics.jsonl, checkpoint, final.")],
    config: Annotated[Path | None, typer.Option(help="YAML with `rl:`/`rollout:` sections (or a run config).")] = None,
    steps: Annotated[int | None, typer.Option(help="RL steps.")] = None,
    estimator: Annotated[Literal["grpo", "dr_grpo", "rloo"] | None, typer.Option(help="Advantage estimator.")] = None,
    credit: Annotated[Literal["trajectory", "turn"] | None, typer.Option(help="Credit assignment.")] = None,
    group_size: Annotated[int | None, typer.Option(help="Rollouts per task.")] = None,
    tasks_per_step: Annotated[int | None, typer.Option(help="Tasks per step.")] = None,
    learning_rate: Annotated[float | None, typer.Option(help="Learning rate.")] = None,
    kl_coef: Annotated[float | None, typer.Option(help="KL penalty weight to the starting policy.")] = None,
    lora_r: Annotated[int | None, typer.Option(help="Train a LoRA adapter of this rank (merged at the end).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint in OUT.")] = False,
    seed: Annotated[int, typer.Option(help="Seed for task order and sampling.")] = 0,
):
    """Online multi-turn RL (GRPO, Dr.GRPO, RLOO; trajectory- or turn-level credit) with trajlab rollouts."""
    from trajlab.chat.template import resolve_chat_template
    from trajlab.env.mixture import load_envs
    from trajlab.models import load_tokenizer
    from trajlab.train.rl import run_rl

    settings = _section(config, "rl", {"steps": steps, "estimator": estimator, "credit": credit,
                                       "group_size": group_size, "tasks_per_step": tasks_per_step,
                                       "learning_rate": learning_rate, "kl_coef": kl_coef,
                                       "lora": {"r": lora_r} if lora_r else None})
    rollout = _section(config, "rollout", {})
    try:
        spec = load_envs(env)
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    tokenizer = load_tokenizer(model)

    def show(record: dict) -> None:
        console.print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))

    final = run_rl(model, tokenizer, resolve_chat_template(tokenizer), spec, settings, rollout, out, seed=seed,
                   resume=resume, on_step=show)
    console.print(f"RL done: {final} (metrics in {out / 'metrics.jsonl'})")


@app.command()
def evolve(
    config: Annotated[Path | None, typer.Option(help="A run config: its env, model, rollout and evolve sections "
                                                "(see configs/evolve.yaml); the options below override it.")] = None,
    env: Annotated[str | None, typer.Option(help="Registered env name or import path 'my_pkg.envs:MyEnv'.")] = None,
    policy: Annotated[str | None, typer.Option(help=PolicyHelp + " Default: the config's model (model.path, else "
                                               "the tiny model).")] = None,
    reflection: Annotated[str | None, typer.Option(
        help="Reflection LM: a model directory or an OpenAI-compatible server's URL http://host:port/v1\\[#model] "
             "(chat completions). Default: evolve.reflection, else the policy's own model.")] = None,
    out: Annotated[Path | None, typer.Option(help="Run dir: gepa/ (state and rollouts; re-running resumes) and "
                                             "result/. Default: RUN_DIR/evolve.")] = None,
    max_metric_calls: Annotated[int | None, typer.Option(
        min=1, help="Rollout budget: one episode is one metric call (default 200).")] = None,
    train_tasks: Annotated[int | None, typer.Option(min=1, help="Train-split tasks GEPA reflects on (32).")] = None,
    val_tasks: Annotated[int | None, typer.Option(
        min=1, help="The next train-split tasks, scoring every candidate (16).")] = None,
    minibatch_size: Annotated[int | None, typer.Option(min=1, help="Tasks per reflection minibatch (3).")] = None,
    tool: Annotated[list[str] | None, typer.Option(
        help="Also evolve this tool's description; repeatable, or 'all'.")] = None,
    use_merge: Annotated[bool | None, typer.Option(help="Also merge Pareto-front candidates.")] = None,
    seed_prompt: Annotated[str | None, typer.Option(help="The system prompt to start from (default: the env's).")] = (
        None),
    prompt_file: Annotated[Path | None, typer.Option(
        help="Start from an earlier result: a best_candidate.json or a text file.")] = None,
    tokenizer: OracleTokenizer = None,
    seed: Annotated[int | None, typer.Option(help="Task order and GEPA seed.")] = None,
    settings: Annotated[list[str] | None, typer.Option(
        "--set", help="Override any config key, e.g. --set rollout.max_turns=4 (value read as YAML).")] = None,
):
    """Evolve the system prompt (and chosen tool descriptions) with GEPA on rollouts; writes OUT/result/."""
    from trajlab.env.mixture import load_envs
    from trajlab.pipeline import evolve_stage, resolve_model

    overrides = _overrides(settings)
    overrides.setdefault("evolve", {}).update({key: value for key, value in {
        "reflection": reflection, "max_metric_calls": max_metric_calls, "train_tasks": train_tasks,
        "val_tasks": val_tasks, "minibatch_size": minibatch_size, "use_merge": use_merge,
        "tools": ("all" if tool == ["all"] else tool) if tool else None}.items() if value is not None})
    overrides.setdefault("rollout", {}).update({key: value for key, value in {
        "system_prompt": seed_prompt, "prompt_file": str(prompt_file) if prompt_file else None}.items()
        if value is not None})
    if env is not None:
        overrides["env"] = env
    if seed is not None:
        overrides["seed"] = seed
    pipeline = _load_pipeline_config(config, overrides)
    if not isinstance(pipeline.env, str) or "," in pipeline.env:
        raise _fail("trajlab evolve runs one env; pass a single --env.")
    out = out or Path(pipeline.run_dir) / "evolve"
    try:
        if policy is not None:
            _check_policy(policy)
        summary = evolve_stage(pipeline, load_envs(pipeline.env), policy or str(resolve_model(pipeline)), out,
                               log=_gepa_line, tokenizer=tokenizer)
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    console.print(f"{summary['candidates']} candidates, {summary['rollouts']} rollouts "
                  f"({summary['rollouts_this_run']} this run) for {summary['metric_calls']} metric calls; "
                  f"validation score {summary['seed_val_score']:.3f} (seed) -> {summary['best_val_score']:.3f} "
                  f"(best, #{summary['best_index']}). Wrote {out / 'result'}")


def _gepa_line(message: str) -> None:
    """A GEPA log line on the console, cut to one screen line (whole texts are in gepa.log)."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    cut = line if len(line) <= 160 and "\n" not in message.strip() else line[:160] + " [...]"
    console.print(Text.assemble((time.strftime("%H:%M:%S"), "dim"), " ", cut), highlight=False)


def _overrides(settings: list[str] | None) -> dict:
    """``--set KEY=VALUE`` items as nested config overrides (values read as YAML)."""
    import yaml

    overrides: dict = {}
    for item in settings or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _fail(f"--set takes KEY=VALUE (e.g. rl.steps=5), got {item!r}.")
        *parents, leaf = key.split(".")
        node = overrides
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return overrides


def _load_pipeline_config(config: Path | None, overrides: dict):
    """A run config from a file (or, with no file, from the overrides alone); errors name each bad key."""
    from trajlab.config import ConfigError, load_config

    if config is None and "env" not in overrides:
        raise _fail("give --env, or a --config naming one.")
    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        raise _fail(str(exc)) from exc


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Pipeline YAML (see configs/quickstart.yaml).")],
    run_dir: Annotated[str | None, typer.Option(help="Override run_dir from the config.")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the training seed.")] = None,
    settings: Annotated[list[str] | None, typer.Option(
        "--set", help="Override any key, e.g. --set rl.steps=5 --set model.init_seed=1 (value read as YAML).")
    ] = None,
):
    """Run the whole pipeline from one config: collect -> dataset -> SFT -> eval -> RL -> eval."""
    from trajlab.evaluate import results_table
    from trajlab.pipeline import run_pipeline

    overrides = _overrides(settings)
    overrides.update({k: v for k, v in {"run_dir": run_dir, "seed": seed}.items() if v is not None})
    pipeline = _load_pipeline_config(config, overrides)
    started = time.perf_counter()
    try:
        reports = run_pipeline(pipeline, log=lambda line: console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {line}"))
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    metrics = ("success_rate", "mean_reward", "mean_turns", "tool_error_rate", "parse_error_rate")
    metrics += tuple(f"reward/{name}" for name in ("progress",) if any(name in r.reward_components for r in reports))
    env_label = pipeline.env if isinstance(pipeline.env, str) else ",".join(pipeline.env)
    table = results_table(reports, metrics=metrics, title=f"{env_label}: held-out {pipeline.eval.split} tasks")
    console.print(table)
    console.print(f"Run saved in {pipeline.run_dir} ({time.perf_counter() - started:.0f}s)")


eval_app = typer.Typer(
    help="Evaluate a policy on held-out tasks (success rate, pass@k, per-task table), or compare two evaluations.",
    invoke_without_command=True,
    no_args_is_help=True,
)
app.add_typer(eval_app, name="eval")


@eval_app.callback()
def eval_run(
    ctx: typer.Context,
    env: Annotated[str | None, typer.Option(help="Registered env name or import path 'my_pkg.envs:MyEnv'; "
                                            "comma-separated names mix envs.")] = None,
    policy: Annotated[str | None, typer.Option(help=PolicyHelp)] = None,
    out: Annotated[Path | None, typer.Option(help="Run dir for trajectories.jsonl + eval.json; resumed.")] = None,
    num_tasks: Annotated[int | None, typer.Option(min=1, help="Tasks to use (default 32, or all of --tasks).")] = None,
    samples_per_task: Annotated[int, typer.Option(min=1, help="Episodes per task; pass@k needs k <= this.")] = 1,
    k: Annotated[list[int] | None, typer.Option("--k", min=1, help="pass@k budget; repeatable (default 1, K).")] = None,
    label: Annotated[str | None, typer.Option(help="Run name in tables (default: the policy's name).")] = None,
    split: Split = "test",
    seed: Seed = 0,
    tasks: TasksFile = None,
    tokenizer: OracleTokenizer = None,
    parser: Parser = "auto",
    concurrency: Concurrency = 8,
    max_turns: MaxTurns = 8,
    max_episode_tokens: MaxEpisodeTokens = 2048,
    max_new_tokens: MaxNewTokens = 128,
    temperature: Temperature = 0.0,
    tool_timeout: ToolTimeout = 10.0,
    system_prompt: SystemPrompt = None,
    prompt_file: PromptFile = None,
    max_tasks: Annotated[int, typer.Option(min=0, help="Task rows to print (weakest first).")] = 20,
):
    """Roll out POLICY on SPLIT with --samples-per-task episodes per task, write OUT/eval.json, print the tables.

    `trajlab eval compare A.json B.json` compares two saved evaluations instead.
    """
    if ctx.invoked_subcommand is not None:
        return  # `trajlab eval compare ...`: this callback only runs an evaluation when no subcommand is given
    from trajlab.collect import collected
    from trajlab.env.registry import read_tasks_file
    from trajlab.evaluate import evaluate_trajectories, report_table, save_report

    missing = [f"--{name}" for name, value in (("env", env), ("policy", policy), ("out", out)) if value is None]
    if missing:
        raise _fail(f"trajlab eval needs {', '.join(missing)} (or: trajlab eval compare A.json B.json).")
    ks = sorted(set(k or [1, samples_per_task]))
    if ks[-1] > samples_per_task:
        raise _fail(f"pass@{ks[-1]} needs --samples-per-task >= {ks[-1]}; got {samples_per_task}.")
    try:
        if num_tasks is None:
            num_tasks = len(read_tasks_file(tasks)) if tasks is not None else 32
        config = _collect_config(
            env, policy, num_tasks * samples_per_task, out / "trajectories.jsonl", split=split, seed=seed,
            samples_per_task=samples_per_task, tasks=tasks, tokenizer=tokenizer, parser=parser,
            concurrency=concurrency, max_turns=max_turns, max_episode_tokens=max_episode_tokens,
            max_new_tokens=max_new_tokens, temperature=temperature, tool_timeout=tool_timeout,
            system_prompt=system_prompt, prompt_file=prompt_file,
        )
        summary = _collect_with_progress(config, "eval")
        report = evaluate_trajectories(
            collected(config),
            ks=ks,
            label=label or _policy_label(policy),
            tokens_per_s=summary["tokens_per_s"] or None,  # None when every episode was already on disk
        )
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    path = save_report(report, out / "eval.json")
    console.print(report_table(report, max_tasks=max_tasks))
    console.print(f"Wrote {config.out} and {path}")


@eval_app.command("compare")
def eval_compare(
    a: Annotated[Path, typer.Argument(help="The baseline eval.json.")],
    b: Annotated[Path, typer.Argument(help="The eval.json to compare with it (deltas are B - A).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON instead of a table.")] = False,
    max_tasks: Annotated[int, typer.Option(min=0, help="Changed tasks to print (largest change first).")] = 20,
):
    """Compare two evaluations: every metric with its delta, and the tasks whose success changed."""
    from trajlab.evaluate import compare_reports, comparison_table, load_report

    try:
        report_a, report_b = load_report(a), load_report(b)
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    if report_a.label == report_b.label:  # two runs of one policy: name the columns by file instead
        report_a = report_a.model_copy(update={"label": str(a)})
        report_b = report_b.model_copy(update={"label": str(b)})
    comparison = compare_reports(report_a, report_b)
    if as_json:
        typer.echo(json.dumps(comparison, indent=2))
        return
    console.print(comparison_table(comparison, max_tasks=max_tasks))


@app.command()
def serve(
    model: Annotated[Path | None, typer.Option(help="Model directory served by the hf backend.")] = None,
    upstream: Annotated[str | None, typer.Option(
        help="Instead of --model: forward to this OpenAI-compatible server (e.g. http://127.0.0.1:8001/v1) and "
             "record in between.")] = None,
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to bind; 0.0.0.0 exposes the server to the network.")] = (
        "127.0.0.1"),
    served_model_name: Annotated[str | None, typer.Option(help="Name clients pass as `model` (default: the "
                                                          "model directory's name).")] = None,
    record_dir: Annotated[Path, typer.Option(help="One JSONL file of call records per session.")] = Path(
        "runs/serve/sessions"),
    parser: Parser = "auto",
    max_batch_size: Annotated[int, typer.Option(min=1, help="Most generations batched together.")] = 32,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Larger request bodies get 413.")] = 4 << 20,
    device: Annotated[str, typer.Option(help="torch device for the model, e.g. cpu or cuda.")] = "cpu",
):
    """Serve a model over an OpenAI-compatible API and record every session's calls with exact token ids."""
    uvicorn = require("uvicorn", feature="trajlab serve", install="pip install 'trajlab[serve]'")
    from trajlab.proxy.server import ServeConfig, build_app

    if upstream is not None and (model is not None or served_model_name is not None):
        raise _fail("--upstream forwards to a server that serves its own model: drop --model and "
                    "--served-model-name (--parser, --max-batch-size and --device do not apply either).")
    config = ServeConfig(model=model, upstream=upstream, served_model_name=served_model_name, record_dir=record_dir,
                         parser=parser, max_batch_size=max_batch_size, max_body_bytes=max_body_bytes, device=device)
    try:
        server_app = build_app(config)
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    console.print(f"Serving {model or upstream} on http://{host}:{port}/v1; recording sessions to {record_dir}/")
    uvicorn.run(server_app, host=host, port=port, log_level="warning")


traces_app = typer.Typer(help="Recorded `trajlab serve` sessions: export them as trajectories.", no_args_is_help=True)
app.add_typer(traces_app, name="traces")


@traces_app.command("export")
def traces_export(
    out: Annotated[Path, typer.Option(help="Trajectory file (JSONL); appended to, ids already there are kept.")],
    tokenizer: Annotated[Path, typer.Option(help="The served model's directory (its tokenizer and chat template).")],
    record_dir: Annotated[Path, typer.Option(help="Directory of the session files.")] = Path("runs/serve/sessions"),
    session: Annotated[list[str] | None, typer.Option(help="Session id to export; repeatable (default: all).")] = None,
    env: Annotated[str, typer.Option(help="The trajectories' env field.")] = "recorded",
    reward: Annotated[str | None, typer.Option(help="Score each trajectory with 'module:function' (returns a "
                                               "float, or (float, success)); unscored ones are failures.")] = None,
    choice: Annotated[int, typer.Option(min=0, help="Which choice of each call extends the history.")] = 0,
    all_choices: Annotated[bool, typer.Option(help="Also export every other choice of n > 1 calls as a fork.")] = False,
    drop_if: Annotated[list[str] | None, typer.Option(help="Drop auxiliary calls: KEY=REGEX with KEY system, tools, "
                                                      "model or endpoint (e.g. 'tools=^$'); repeatable.")] = None,
):
    """Rebuild trajectories from session recordings: calls that extend a conversation merge, edited ones fork."""
    from trajlab.chat.template import resolve_chat_template
    from trajlab.data.store import StoreError
    from trajlab.models import load_tokenizer
    from trajlab.proxy.export import DropRule, export_sessions, load_reward, session_files

    try:
        rules = [DropRule.parse(rule) for rule in drop_if or []]
        score = load_reward(reward) if reward else None
        paths = session_files(record_dir, session)
        loaded = load_tokenizer(tokenizer)
        summary = export_sessions(paths, out, loaded, resolve_chat_template(loaded), env=env, reward=score,
                                  choice=choice, all_choices=all_choices, drop=rules)
    except (OSError, StoreError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    console.print(f"Exported {summary['written']} trajectories to {out} from {summary['sessions']} sessions "
                  f"({summary['calls']} calls, {summary['samples']} samples; {summary['already']} already there, "
                  f"{summary['dropped']} calls dropped, {summary['skipped']} skipped)")


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


def main() -> None:
    """The ``trajlab`` command.

    A :class:`UserError` (a missing optional package included) is printed as one line and exits 1; anything else is
    a bug and keeps its traceback.
    """
    try:
        app()
    except UserError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
