"""``trajlab dataset``, ``sft``, ``rl``, ``evolve`` and ``run``: from trajectories to a trained model or prompt."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from trajlab.cli.common import ConfigFile, ConfigOption, Sets, config_options, console, load, setting, usage_error
from trajlab.cli.output import progress, say
from trajlab.cli.rollouts import POLICY_HELP, Tokenizer

ModelDir = Annotated[Path | None, typer.Option("--model", help="Model directory to train (default: the config's "
                                               "model.path).")]
Resume = Annotated[bool, typer.Option(help="Continue from the newest checkpoint in OUT.")]


@config_options("dataset.include_failures", "dataset.shortest_per_task", "dataset.max_tokens")
def dataset_command(
    kind: Annotated[Literal["sft", "rl", "preference"], typer.Option(
        help="sft: demonstrations; rl: the distinct tasks to roll out; preference: (success, failure) pairs for DPO.")],
    sources: Annotated[list[Path], typer.Option("--from", help="Trajectory file (JSONL); repeat to combine files.")],
    out: Annotated[Path, typer.Option(help="Output: FILE.jsonl, FILE.parquet, or a directory (save_to_disk).")],
    format: Annotated[Literal["disk", "jsonl", "parquet"] | None, typer.Option(
        "--format", help="Output format (default: from OUT's suffix).")] = None,
    push_to_hub: Annotated[str | None, typer.Option(
        help="Also upload OUT to this Hub dataset repository, user-or-org/name (created if missing); needs a token "
             "with write access (HF_TOKEN, or `hf auth login`).")] = None,
    private: Annotated[bool, typer.Option(help="With --push-to-hub: create the repository private.")] = False,
    config: ConfigFile = None,
    sets: Sets = None,
    *,
    given: dict[str, Any],
) -> None:
    """Turn trajectory files into a Hugging Face dataset for SFT, RL or preference training.

    --kind sft is shaped by the config's dataset section, as the run's sft stage is: `--config` of a run builds the
    SFT data that run trains on. The section is about SFT data only: for --kind rl and preference, its options on
    the command line are refused, and the section in a --config or --set is not read.
    """
    from trajlab.data.datasets import preference_dataset, rl_dataset, save_dataset, sft_dataset
    from trajlab.data.store import read_trajectories
    from trajlab.models import hub

    if kind != "sft" and any(value is not None for value in given.values()):
        raise usage_error("--include-failures, --shortest-per-task and --max-tokens apply to --kind sft only.")
    if private and push_to_hub is None:
        raise usage_error("--private applies to --push-to-hub only.")
    if push_to_hub is not None:
        hub.hub_token()  # no token: said before the dataset is built, not after
    shaping = load(config, sets, given).dataset
    trajectories = [t for source in sources for t in read_trajectories(source)]
    if not trajectories:
        raise ValueError(f"no trajectories in {', '.join(map(str, sources))}: nothing to build a dataset from "
                         "(collect some with `trajlab collect`)")
    if kind == "sft":
        built = sft_dataset(trajectories, **shaping.model_dump())
    else:
        built = rl_dataset(trajectories) if kind == "rl" else preference_dataset(trajectories)
    path = save_dataset(built, out, format)
    console.print(f"Wrote {len(built)} {kind} rows from {len(trajectories)} trajectories to {path}")
    if push_to_hub is not None:
        url = hub.push_to_hub(path, push_to_hub, repo_type="dataset", private=private,
                              message=f"Upload {kind} dataset with trajlab")
        console.print(f"Pushed {path} to {push_to_hub}: {url}")
    if kind == "preference" and len(built) == 0:
        console.print("[yellow]No task has both a success and a failure with the same prompt: nothing to pair.[/]")


def _model_dir(model: Path | None, configured: str | None) -> Path:
    if model is None and configured is None:
        raise usage_error("give --model DIR (or model.path in the config).")
    from trajlab.models.hub import resolve_model_dir

    return resolve_model_dir(model or configured)


LORA_RANK = Annotated[int | None, typer.Option(min=1, help="Train a LoRA adapter of this rank, merged at the end "
                                               "(the config's sft.lora.r / rl.lora.r).")]
TRAINING_OPTIONS: tuple[ConfigOption, ...] = ("seed", "model.device", "model.dtype", "report_to")
"""What every training command takes besides its stage's settings: the seed, where it trains, its trackers."""


@config_options("sft.epochs", "sft.max_steps", "sft.learning_rate", "sft.batch_size", "sft.gradient_checkpointing",
                *TRAINING_OPTIONS)
def sft_command(
    out: Annotated[Path, typer.Option(help="Output directory: checkpoints, then out/final.")],
    model: ModelDir = None,
    sources: Annotated[list[Path] | None, typer.Option("--from", help="Trajectory file(s); successes are used.")] = (
        None),
    data: Annotated[Path | None, typer.Option(help="A dataset written by `trajlab dataset --kind sft`.")] = None,
    lora_r: LORA_RANK = None,
    resume: Resume = False,
    config: ConfigFile = None,
    sets: Sets = None,
    *,
    given: dict[str, Any],
) -> None:
    """Supervised fine-tuning on trajectories, with loss on the model's own tokens only."""
    import trajlab
    from trajlab.data.datasets import load_saved_dataset
    from trajlab.data.store import read_trajectories

    if (sources is None) == (data is None):
        raise usage_error("give exactly one of --from TRAJECTORIES.jsonl or --data DATASET.")
    settings = load(config, sets, given | {"sft.lora": {"r": lora_r} if lora_r else None})
    path = _model_dir(model, settings.model.path)
    built = [t for s in sources for t in read_trajectories(s)] if sources else load_saved_dataset(data)
    with progress("sft") as on_progress:
        final = trajlab.sft(path, built, out, seed=settings.seed, resume=resume, dataset=settings.dataset,
                            parser=settings.rollout.parser, device=settings.model.device, dtype=settings.model.dtype,
                            report_to=settings.report_to, on_progress=on_progress, **settings.sft.model_dump())
    console.print(f"SFT on {len(built)} {'trajectories' if sources else 'rows'} done: {final}")


@config_options("rl.steps", "rl.estimator", "rl.credit", "rl.group_size", "rl.tasks_per_step", "rl.learning_rate",
                "rl.kl_coef", "rl.gradient_checkpointing", "rl.demonstrations", *TRAINING_OPTIONS, "model.backend")
def rl_command(
    out: Annotated[Path, typer.Option(help="Output directory: metrics.jsonl, checkpoint, final.")],
    model: ModelDir = None,
    env: Annotated[str | None, typer.Option(help="Registered env name or import path; comma-separated names mix "
                                            "envs. Default: the config's env.")] = None,
    lora_r: LORA_RANK = None,
    skip_tasks_of: Annotated[Path | None, typer.Option(help="A trajectory file, such as the demonstrations SFT "
                                                       "learned from: RL draws none of its tasks (`trajlab run` "
                                                       "leaves out its demos.jsonl's).")] = None,
    resume: Resume = False,
    config: ConfigFile = None,
    sets: Sets = None,
    *,
    given: dict[str, Any],
) -> None:
    """Online multi-turn RL (GRPO, Dr.GRPO, RLOO; trajectory- or turn-level credit) with trajlab rollouts."""
    import trajlab
    from trajlab.data.store import task_keys

    settings = load(config, sets, given | {"env": env, "rl.lora": {"r": lora_r} if lora_r else None})
    path = _model_dir(model, settings.model.path)

    def show(record: dict) -> None:
        say(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))

    skipped = task_keys(skip_tasks_of) if skip_tasks_of else frozenset()
    final = trajlab.rl(path, settings.env_spec(), out, rollout=settings.rollout, seed=settings.seed, resume=resume,
                       on_step=show, device=settings.model.device, dtype=settings.model.dtype,
                       backend=settings.model.backend, vllm=settings.model.vllm, report_to=settings.report_to,
                       curriculum=settings.curriculum, skip_tasks=skipped, **settings.rl.model_dump())
    console.print(f"RL done: {final} (metrics in {out / 'metrics.jsonl'})")


@config_options("evolve.reflection", "evolve.max_metric_calls", "evolve.train_tasks", "evolve.val_tasks",
                "evolve.minibatch_size", "evolve.use_merge", ("rollout.system_prompt", "--seed-prompt"),
                "rollout.prompt_file", *TRAINING_OPTIONS, "model.backend")
def evolve_command(
    config: ConfigFile = None,
    env: Annotated[str | None, typer.Option(help="Registered env name or import path 'my_pkg.envs:MyEnv'.")] = None,
    policy: Annotated[str | None, typer.Option(help=POLICY_HELP + " Default: the config's model (model.path, else "
                                               "the tiny model).")] = None,
    out: Annotated[Path | None, typer.Option(help="Run dir: gepa/ (state and rollouts; re-running resumes) and "
                                             "result/. Default: RUN_DIR/evolve.")] = None,
    tool: Annotated[list[str] | None, setting("evolve.tools", "--tool")] = None,
    tokenizer: Tokenizer = None,
    sets: Sets = None,
    *,
    given: dict[str, Any],
) -> None:
    """Evolve the system prompt (and chosen tool descriptions) with GEPA on rollouts; writes OUT/result/."""
    import trajlab
    from trajlab.recipes.pipeline import resolve_model

    tools = ("all" if tool == ["all"] else tool) if tool else None
    settings = load(config, sets, given | {"env": env, "evolve.tools": tools})
    spec = settings.env_spec()
    if not isinstance(settings.env, str) or "," in settings.env:
        raise usage_error("trajlab evolve runs one env; pass a single --env.")
    out = out or Path(settings.run_dir) / "evolve"
    summary = trajlab.evolve(spec, policy or str(resolve_model(settings)), out, tokenizer=tokenizer,
                             rollout=settings.rollout, seed=settings.seed, log=say, device=settings.model.device,
                             dtype=settings.model.dtype, backend=settings.model.backend, vllm=settings.model.vllm,
                             report_to=settings.report_to, **settings.evolve.model_dump())
    console.print(f"{summary['candidates']} candidates, {summary['rollouts']} rollouts "
                  f"({summary['rollouts_this_run']} this run) for {summary['metric_calls']} metric calls; "
                  f"validation score {summary['seed_val_score']:.3f} (seed) -> {summary['best_val_score']:.3f} "
                  f"(best, #{summary['best_index']}). Wrote {out / 'result'}")


@config_options("run_dir", "seed", "model.device", "model.dtype", "report_to")
def run_command(
    config: Annotated[Path, typer.Argument(help="Pipeline YAML (see configs/quickstart.yaml).")],
    sets: Sets = None,
    *,
    given: dict[str, Any],
) -> None:
    """Run the whole pipeline from one config: collect -> dataset -> SFT -> eval -> RL -> eval."""
    from trajlab.evaluation import results_table
    from trajlab.recipes.pipeline import run_pipeline

    settings = load(config, sets, given)
    started = time.perf_counter()
    reports = run_pipeline(settings, log=say, progress=progress)
    metrics = ("success_rate", "mean_reward", "mean_turns", "tool_error_rate", "parse_error_rate")
    metrics += tuple(f"reward/{name}" for name in ("progress",) if any(name in r.reward_components for r in reports))
    env_label = settings.env if isinstance(settings.env, str) else ",".join(settings.env or [])
    table = results_table(reports, metrics=metrics, title=f"{env_label}: held-out {settings.eval.split} tasks")
    console.print(table)
    console.print(f"Run saved in {settings.run_dir} ({time.perf_counter() - started:.0f}s)")
