"""The ``trajlab run`` recipe: collect demonstrations -> dataset -> SFT -> eval -> RL -> eval, from one config.

An ``evolve`` stage evolves the system prompt (and chosen tool descriptions) of the current model with GEPA; the
stages after it roll out with the evolved texts.

Every stage uses the same env, tool schemas, parser, chat template and reward. Each stage leaves its result in the
run directory and is skipped when that result is already there, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import yaml

from trajlab.collection.demonstrators import named_reference
from trajlab.config import PipelineConfig
from trajlab.data.datasets import save_dataset, sft_dataset
from trajlab.data.store import read_trajectories, task_keys
from trajlab.errors import require
from trajlab.evaluation import EvalReport
from trajlab.models.hub import resolve_model_dir
from trajlab.models.loading import load_processor, load_tokenizer
from trajlab.models.tiny import init_tiny
from trajlab.recipes.arguments import Progress
from trajlab.recipes.collect import collect
from trajlab.recipes.evaluate import evaluate
from trajlab.recipes.evolve import evolve
from trajlab.recipes.rl import rl
from trajlab.recipes.sft import sft
from trajlab.report import write_report
from trajlab.rollout.drift import without_drift
from trajlab.rollout.types import Trajectory
from trajlab.train.curriculum import build_stages

Log = Callable[[str], None]
ProgressFor = Callable[[str], AbstractContextManager[Progress | None]]
"""``progress(label)``: a context that yields the ``on_progress(done, total)`` of one long piece of work."""


def run_pipeline(config: PipelineConfig, log: Log = print, progress: ProgressFor | None = None) -> list[EvalReport]:
    """Run the configured stages in order; returns the evaluation reports, one per ``eval`` stage.

    ``log`` gets a line per finished piece of work (and per RL step, per GEPA message); ``progress`` shows the
    progress of collection, evaluations and SFT.
    """
    progress = progress or (lambda label: nullcontext(None))
    run = Path(config.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    _require_extras(config)
    env = config.env_spec()
    if config.tasks is not None:  # a dataset may lack a split a stage draws: say so before the first stage
        needed = {"collect": config.collect.split, "eval": config.eval.split, "rl": "train", "evolve": "train"}
        for split in sorted({needed[stage] for stage in config.stages if stage in needed}):
            next(iter(env.iter_tasks(split, config.seed)), None)
    if config.curriculum is not None and "rl" in config.stages:  # a bad stage fails now, not after the stages before
        build_stages(config.curriculum, env, config.rollout)
    if config.collect.reference and "collect" in config.stages:  # likewise a reference the env does not have
        named_reference(env, config.collect.reference)
    base = resolve_model(config, log)

    current, label, reports = base, "untrained" if config.model.path is None else "base", []
    demos: list[Trajectory] | None = None  # the collect stage's, in its plan's order
    for stage in config.stages:
        started = time.perf_counter()
        if stage == "collect":
            with progress("collect") as on_progress:
                demos = collect(env, "oracle", out=run / "demos.jsonl", tokenizer=str(base), seed=config.seed,
                                    rollout=config.rollout, on_progress=on_progress, **_placement(config),
                                    **config.collect.model_dump())
            rate = sum(t.status == "success" for t in demos) / len(demos)
            log(f"collect: {len(demos)} demonstrations, success rate {rate:.3f}")
        elif stage == "sft":
            with progress("sft") as on_progress:
                current, label = _sft(config, current, run, log, demos, on_progress), "sft"
        elif stage == "rl":
            current, label = _rl(config, env, current, run, log), "rl"
        elif stage == "evolve":
            candidate = _evolve(config, env, current, run / "evolve", log)
            rollout = config.rollout.model_copy(update={"system_prompt": None, "prompt_file": str(candidate)})
            config, label = config.model_copy(update={"rollout": rollout}), f"{label}+evolved"
        elif stage == "eval":
            with progress(f"eval ({label})") as on_progress:
                reports.append(evaluate(env, str(current), out=run / f"eval-{len(reports)}-{label}",
                                            rollout=config.rollout, rewards=_eval_rewards(config), label=label,
                                            **_placement(config), backend=config.model.backend, vllm=config.model.vllm,
                                            report_to=config.report_to, on_progress=on_progress,
                                            **config.eval.model_dump(exclude={"rewards"})))
            log(f"eval ({label}): success rate {reports[-1].success_rate:.3f}, "
                f"mean reward {reports[-1].mean_reward:.3f}")
        log(f"{stage} took {time.perf_counter() - started:.0f}s")
    (run / "results.json").write_text(json.dumps([r.model_dump(mode="json") for r in reports], indent=2))
    log(f"report: {write_report([run], run / 'report.html')} (trajlab report {run} writes it again)")
    return reports


def _eval_rewards(config: PipelineConfig) -> dict[str, Any]:
    """The rewards an eval stage reports: ``eval.rewards``, else the ones RL trains on."""
    return config.eval.rewards if config.eval.rewards is not None else config.rl.rewards


def _require_extras(config: PipelineConfig) -> None:
    """Fail before the first stage, not after the ones before it, when a configured stage needs an optional package."""
    if "evolve" in config.stages:
        require("gepa", feature="the evolve stage", install="pip install 'trajlab[evolve]'")
    if ("sft" in config.stages and config.sft.lora) or ("rl" in config.stages and config.rl.lora):
        require("peft", feature="LoRA (lora: settings)", install="pip install 'trajlab[lora]'")
    if config.model.backend == "vllm":
        from trajlab.inference.vllm import INSTALL

        require("vllm", feature="the vllm backend (model.backend: vllm)", install=INSTALL)


def resolve_model(config: PipelineConfig, log: Log = print) -> Path:
    """The config's starting model: ``model.path`` (a directory, or a Hugging Face name: its snapshot in the cache),
    or the tiny model, built in the run directory on first use: the tiny vision-language one when the env's tools
    return images, which a text model cannot take."""
    if config.model.path:
        return resolve_model_dir(config.model.path)
    base = Path(config.run_dir) / "model"
    if not (base / "config.json").exists():
        _, kind = init_tiny(base, seed=config.model.init_seed, vision=config.env_spec().shows_images, overwrite=True)
        log(f"built the {kind} in {base}")
    return base


def _placement(config: PipelineConfig) -> dict[str, str]:
    """``model.device`` and ``model.dtype``, for every stage that loads a model."""
    return {"device": config.model.device, "dtype": config.model.dtype}


def _evolve(config: PipelineConfig, env: Any, model: Path, out: Path, log: Log) -> Path:
    """The evolve stage; returns the best candidate's file, which the later stages roll out with."""
    result = out / "result"
    done = json.loads((result / "summary.json").read_text()) if (result / "summary.json").exists() else {}
    if done.get("max_metric_calls") == config.evolve.max_metric_calls:
        log(f"evolve: already done ({result})")
    else:
        summary = evolve(env, str(model), out, rollout=config.rollout, seed=config.seed,
                             log=lambda message: log(f"evolve: {message}"), backend=config.model.backend,
                             vllm=config.model.vllm, **_placement(config),
                             report_to=config.report_to, **config.evolve.model_dump())
        log(f"evolve: {summary['candidates']} candidates, {summary['rollouts']} rollouts; validation score "
            f"{summary['seed_val_score']:.3f} (seed) -> {summary['best_val_score']:.3f} (best)")
    return result / "best_candidate.json"


def _sft(config: PipelineConfig, model: Path, run: Path, log: Log, demos: list[Trajectory] | None,
         on_progress: Progress | None) -> Path:
    """SFT on the collect stage's demonstrations in their plan's order (the same data order every run), or, without
    a collect stage in this run, on ``demos.jsonl`` in its file order."""
    final = run / "sft" / "final"
    if (final / "config.json").exists():
        log(f"sft: already done ({final})")
        return final
    if demos is None:
        demos = list(read_trajectories(run / "demos.jsonl"))
    if not any(t.status == "success" for t in demos):
        statuses = sorted({f"{t.status} ({t.stop_reason})" for t in demos})
        raise ValueError(f"No successful demonstration in {run / 'demos.jsonl'} to fine-tune on (episodes ended: "
                         f"{', '.join(statuses)}); raise rollout.max_new_tokens or rollout.max_turns if truncated.")
    checked = without_drift(demos, load_tokenizer(model), parser=config.rollout.parser,
                                max_drift=config.sft.max_drift, processor=load_processor(model))
    dataset = sft_dataset(checked, include_failures=config.dataset.include_failures,
                          shortest_per_task=config.dataset.shortest_per_task, max_tokens=config.dataset.max_tokens)
    save_dataset(dataset, run / "sft_dataset")
    log(f"sft: {len(dataset)} rows ({len(demos) - len(checked)} of {len(demos)} demonstrations dropped for token "
        "drift)")
    return sft(model, dataset, run / "sft", seed=config.seed, resume=True, **_placement(config),
                   report_to=config.report_to, on_progress=on_progress, **config.sft.model_dump())


def _rl(config: PipelineConfig, env: Any, model: Path, run: Path, log: Log) -> Path:
    final = run / "rl" / "final"
    if (final / "config.json").exists():
        log(f"rl: already done ({final})")
        return final

    names = [stage.name for stage in config.curriculum.stages] if config.curriculum else []

    def show(record: dict[str, float]) -> None:
        stage = f" [{names[int(record['curriculum/stage'])]}]" if "curriculum/stage" in record else ""
        log(f"rl step {record['step']:>3}/{config.rl.steps}{stage}: reward {record['reward/mean']:.3f} "
            f"success {record['rollout/success_rate']:.3f} "
            f"zero-var groups {record['rollout/zero_variance_groups']:.2f} kl {record['loss/kl']:.4f} "
            f"entropy {record['loss/entropy']:.3f} {record['perf/tokens_per_s']:.0f} tok/s")

    # the demonstrations were drawn in the same seeded order as RL's tasks: without this RL would start on exactly
    # the tasks SFT was fitted to. The failed ones' tasks are left out too: drawn first, they would be a sample
    # biased to the demonstrator's mistakes (BENCHMARKS.md: RL on them overshot more)
    demonstrated = task_keys(run / "demos.jsonl") if (run / "demos.jsonl").is_file() else frozenset()
    if demonstrated:
        log(f"rl: leaving out the {len(demonstrated)} train tasks of the demonstrations")
    settings = config.rl.model_dump()
    replay, demonstrations = config.rl.replay_demonstrations, run / "demos.jsonl"
    if config.rl.demonstrations is None and (replay or (replay is None and demonstrations.is_file())):
        settings["demonstrations"] = str(demonstrations)  # the default replay needs them; a set one reads them
    return rl(model, env, run / "rl", rollout=config.rollout, seed=config.seed, resume=True, on_step=show,
                  backend=config.model.backend, vllm=config.model.vllm, report_to=config.report_to,
                  curriculum=config.curriculum, skip_tasks=demonstrated, **_placement(config), **settings)
