"""The Python API: collect, evaluate, sft, rl and evolve, each a function over built objects.

The ``trajlab`` command line is a thin layer over these functions, and ``trajlab run`` wires them stage by stage.
They take what a user has in hand: an env (an :class:`~trajlab.env.registry.EnvSpec`, an env class, a registered
name, or several names for a mixture), tasks as a list of dicts, a policy (``"oracle"``, a model directory, a
server URL, a loaded model, or any :class:`~trajlab.inference.base.Generator`), and settings as keyword arguments.
Keyword settings are the fields of the config section of the same stage (``trajlab config show`` lists them all)
and are validated by it, so a default, a YAML key and a keyword argument are one setting::

    import trajlab

    report = trajlab.evaluate("arithmetic", "oracle", num_tasks=8)
    trajectories = trajlab.recipes.collect("arithmetic", "oracle", episodes=8, rollout={"max_turns": 4})
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from trajlab.config import (
    CollectSettings,
    CurriculumSettings,
    DatasetSettings,
    EvalSettings,
    EvolveSettings,
    ModelSettings,
    RLSettings,
    RolloutSettings,
    SFTSettings,
)
from trajlab.env.mixture import EnvMixture, load_envs
from trajlab.env.registry import EnvSpec
from trajlab.errors import UserError, require
from trajlab.evaluation import EvalReport
from trajlab.inference.policy import Policy, PolicyLike
from trajlab.rollout.types import Trajectory

logger = logging.getLogger(__name__)

EnvLike = EnvSpec | EnvMixture | type | str | Sequence[str]
"""An EnvSpec or mixture, an env class, a registered name or import path, or several names (a mixture)."""
Progress = Callable[[int, int], None]
"""``on_progress(done, total)``, called as episodes finish."""

S = TypeVar("S", bound=BaseModel)


def collect(
    env: EnvLike,
    policy: PolicyLike | Policy,
    *,
    out: str | Path | None = None,
    tasks: Sequence[Mapping[str, Any]] | str | Path | None = None,
    tokenizer: Any = None,
    seed: int = 0,
    rollout: RolloutSettings | Mapping[str, Any] | None = None,
    backend: str | None = None,
    on_progress: Progress | None = None,
    device: str = "auto",
    dtype: str = "auto",
    **settings: Any,
) -> list[Trajectory]:
    """Roll ``policy`` out on ``env`` and return the trajectories.

    Args:
        env: see :data:`EnvLike`.
        policy: see :func:`trajlab.inference.policy.load_policy`.
        out: a trajectory file to append to; an existing one is resumed (only missing episodes run). None: the
            trajectories are only returned.
        tasks: task dicts (or a JSONL file of them) to roll out instead of the env's own split (``episodes``
            cycles through them).
        tokenizer: the trajectories' tokenizer, for the oracle (default: the tiny model's), a server, a loaded
            model or a Generator.
        seed: task order seed.
        rollout: rollout settings (limits, concurrency, parser, prompts); see ``RolloutSettings``.
        backend: what generates for a model directory: ``"hf"`` or ``"vllm"`` (``ModelSettings.backend``; None: its
            default).
        on_progress: called as episodes finish.
        device, dtype: where a model-directory policy is loaded and in what dtype (``ModelSettings``: auto, cpu,
            cuda, cuda:N; auto, float32, bfloat16, float16).
        **settings: ``CollectSettings`` fields: ``episodes``, ``split``, ``samples_per_task``, ``temperature``,
            ``reference`` and ``reference_noise`` (with the ``"oracle"`` policy: imperfect demonstrations, from one
            of the env's named reference policies or with mistakes made on purpose).
    """
    from trajlab.recipes.collect import collect as run_collection
    from trajlab.recipes.collect import collected

    chosen = _settings(CollectSettings, settings)
    with _output(out, "trajectories.jsonl") as path:
        config = _collect_config(env, policy, path, tokenizer=tokenizer, tasks=tasks, seed=seed,
                                 rollout=_settings(RolloutSettings, rollout or {}), episodes=chosen.episodes,
                                 split=chosen.split, samples_per_task=chosen.samples_per_task,
                                 temperature=chosen.temperature, model=_model(device, dtype, backend),
                                 reference=chosen.reference, reference_noise=chosen.reference_noise)
        run_collection(config, on_progress=on_progress)
        return collected(config)


def evaluate(
    env: EnvLike,
    policy: PolicyLike | Policy,
    *,
    out: str | Path | None = None,
    tasks: Sequence[Mapping[str, Any]] | str | Path | None = None,
    tokenizer: Any = None,
    rollout: RolloutSettings | Mapping[str, Any] | None = None,
    rewards: Mapping[str, float] | None = None,
    label: str | None = None,
    backend: str | None = None,
    on_progress: Progress | None = None,
    device: str = "auto",
    dtype: str = "auto",
    report_to: Sequence[str] = (),
    **settings: Any,
) -> EvalReport:
    """Evaluate ``policy`` on held-out tasks: success rate, pass@k, mean reward and turns, error rates, per task.

    Args:
        out: a run directory for ``trajectories.jsonl`` and ``eval.json`` (resumed if it exists); None: nothing
            is written.
        tasks: task dicts to evaluate on instead of the env's split (all of them unless ``num_tasks`` is given).
        rewards: reward-component weights to report (``reward/<name>``); None: the env reward only.
        label: the run's name in tables (default: the policy's).
        report_to: experiment trackers that also get the results, as ``eval/...`` (:mod:`trajlab.tracking`; the
            tracker run is named after ``out``).
        **settings: ``EvalSettings`` fields: ``num_tasks``, ``samples_per_task``, ``ks``, ``temperature``,
            ``split``, ``seed``.
        Other arguments: as for :func:`collect`.
    """
    from trajlab.env.registry import read_tasks_file
    from trajlab.evaluation import evaluate_trajectories, save_report
    from trajlab.evaluation.metrics import eval_metrics
    from trajlab.recipes.collect import collect as run_collection
    from trajlab.recipes.collect import collected
    from trajlab.rollout.rewards import score
    from trajlab.tracking import Trackers, require_trackers

    require_trackers(report_to)
    if report_to and out is None:
        raise UserError("report_to needs out=: the tracker run is named after the evaluation's directory.")
    if tasks is not None and "num_tasks" not in settings:
        count = len(read_tasks_file(tasks)) if isinstance(tasks, str | Path) else len(tasks)
        settings = {**settings, "num_tasks": max(count, 1)}
    chosen = _settings(EvalSettings, settings)
    with _output(out, "") as run_dir:
        config = _collect_config(env, policy, run_dir / "trajectories.jsonl", tokenizer=tokenizer, tasks=tasks,
                                 seed=chosen.seed, rollout=_settings(RolloutSettings, rollout or {}),
                                 episodes=chosen.num_tasks * chosen.samples_per_task, split=chosen.split,
                                 samples_per_task=chosen.samples_per_task, temperature=chosen.temperature,
                                 model=_model(device, dtype, backend))
        summary = run_collection(config, on_progress=on_progress)
        trajectories = collected(config)
        if rewards is not None:
            for trajectory in trajectories:  # every reward component logged alongside success
                score(trajectory, dict(rewards))
        report = evaluate_trajectories(trajectories, ks=chosen.pass_at(), label=label or _label(policy),
                                       tokens_per_s=summary["tokens_per_s"] or None)
        report.errors_run_again = summary["errors_run_again"]
        if out is not None:
            save_report(report, run_dir / "eval.json")
            with Trackers(report_to, run_dir.parent, run_dir.name, config={"eval": chosen.model_dump(mode="json"),
                                                                           "label": report.label}) as trackers:
                trackers.log(eval_metrics(report), step=0)
    return report


def sft(
    model: str | Path | Any,
    data: Iterable[Trajectory] | Any,
    out: str | Path,
    *,
    tokenizer: Any = None,
    processor: Any = None,
    seed: int = 0,
    resume: bool = False,
    dataset: DatasetSettings | Mapping[str, Any] | None = None,
    parser: str = "auto",
    device: str = "auto",
    dtype: str = "auto",
    report_to: Sequence[str] = (),
    on_progress: Progress | None = None,
    **settings: Any,
) -> Path:
    """Fine-tune ``model`` on trajectories (the model's own tokens only); returns ``out/final``.

    Args:
        model: a model directory or a loaded transformers model (then ``tokenizer`` is required).
        data: trajectories (successes are kept unless ``dataset={"include_failures": True}``), or a Hugging Face
            dataset from :func:`trajlab.data.datasets.sft_dataset`. Trajectories pass the drift guard first
            (:func:`without_drift`, ``max_drift`` in ``settings``).
        out: checkpoints, then ``out/final`` (LoRA merged).
        processor: a loaded vision-language model's processor; a model directory's own is loaded (none for a text
            model). Needed when ``data`` holds images.
        dataset: ``DatasetSettings`` applied when ``data`` is trajectories.
        parser: the tool-call parser the trajectories were rolled out with (``rollout.parser``), for the guard.
        device, dtype: where training runs and the dtype a model directory is loaded in (``ModelSettings``).
        report_to: experiment trackers that also get the training logs (``out/metrics.jsonl``).
        on_progress: called with (optimizer steps done, total) after each step, instead of the trainer's own bar.
        **settings: ``SFTSettings`` fields (``epochs``, ``max_steps``, ``learning_rate``, ``lora``...).
    """
    import datasets

    from trajlab.data.datasets import sft_dataset
    from trajlab.tracking import require_trackers
    from trajlab.train.sft import run_sft

    require_trackers(report_to)
    chosen = _settings(SFTSettings, settings)
    loaded, processor = _load_tokenizer(model, tokenizer), _load_processor(model, processor)
    if not isinstance(data, datasets.Dataset):
        shaping = _settings(DatasetSettings, dataset or {})
        data = sft_dataset(without_drift(data, loaded, parser=parser, max_drift=chosen.max_drift, processor=processor),
                           include_failures=shaping.include_failures, shortest_per_task=shaping.shortest_per_task,
                           max_tokens=shaping.max_tokens)
    placed = _model(device, dtype)
    return run_sft(model, loaded, data, out, chosen, seed=seed, resume=resume, device=placed.device,
                   dtype=placed.dtype, report_to=report_to, on_progress=on_progress, processor=processor)


def without_drift(
    trajectories: Iterable[Trajectory], tokenizer: Any, *, parser: str = "auto", max_drift: float = 0.0,
    processor: Any = None,
) -> list[Trajectory]:
    """The trajectories whose tokens are the chat template's rendering of their messages, turn by turn (see
    ``trajlab.rollout.drift``), under ``tokenizer``'s training template; the others are dropped and counted in the
    log. Trajectories with images need the vision-language model's ``processor`` to render them.

    Raises:
        TokenDriftError: more than ``max_drift`` of them drifted (0: any).
    """
    from trajlab.chat.parsers import get_parser
    from trajlab.chat.template import resolve_chat_template
    from trajlab.rollout.drift import check_token_drift

    kept, drifts = check_token_drift(trajectories, tokenizer, resolve_chat_template(tokenizer),
                                     get_parser(parser, tokenizer), max_drift=max_drift, processor=processor)
    if drifts:
        logger.warning("Token drift: %d trajectories dropped, first %s", len(drifts), drifts[0].describe())
    return kept


def rl(
    model: str | Path | Any,
    env: EnvLike,
    out: str | Path,
    *,
    tokenizer: Any = None,
    processor: Any = None,
    rollout: RolloutSettings | Mapping[str, Any] | None = None,
    seed: int = 0,
    resume: bool = False,
    backend: str | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    device: str = "auto",
    dtype: str = "auto",
    report_to: Sequence[str] = (),
    curriculum: CurriculumSettings | Mapping[str, Any] | None = None,
    skip_tasks: Collection[str] = (),
    **settings: Any,
) -> Path:
    """Online multi-turn RL of ``model`` on ``env``'s train tasks; returns ``out/final`` (LoRA merged).

    Args:
        model: a model directory or a loaded transformers model (then ``tokenizer`` is required).
        processor: a loaded vision-language model's processor; a model directory's own is loaded (none for a text
            model). Needed for an env that shows the model images.
        backend: ``"hf"`` rolls out with the model being trained; ``"vllm"`` with an in-process vLLM engine started
            from the model directory, which gets the trainer's weights after every optimizer step.
        on_step: called with each step's metrics (also appended to ``out/metrics.jsonl``).
        report_to: experiment trackers that also get each step's metrics (:mod:`trajlab.tracking`).
        device, dtype: where the policy, its reference and its rollouts run, and the dtype a model directory is
            loaded in (``ModelSettings``).
        curriculum: train stage after stage instead (``CurriculumSettings``: ``{"stages": [...]}``); a stage
            without an env of its own uses ``env``.
        skip_tasks: ids (``task_id``) of train tasks RL does not draw: those SFT's demonstrations came from, which
            SFT fits and RL rarely fails (no gradient); ``trajlab.data.store.task_ids`` reads them from a file.
        **settings: ``RLSettings`` fields (``steps``, ``estimator``, ``credit``, ``group_size``, ``rewards``...).
    """
    from trajlab.chat.template import resolve_chat_template
    from trajlab.tracking import require_trackers
    from trajlab.train.curriculum import Curriculum, build_stages
    from trajlab.train.rl import run_rl

    require_trackers(report_to)  # before any model is loaded
    chosen = _settings(RLSettings, settings)
    loaded, placed = _load_tokenizer(model, tokenizer), _model(device, dtype, backend)
    processor = _load_processor(model, processor)
    chosen_rollout = _settings(RolloutSettings, rollout or {})
    chosen_env = _env(env)
    trained_on = (Curriculum(build_stages(_settings(CurriculumSettings, curriculum), chosen_env, chosen_rollout),
                             seed=seed, skip=skip_tasks) if curriculum is not None
                  else Curriculum.single(chosen_env, chosen_rollout.limit_overrides(), seed=seed, skip=skip_tasks))
    sampler = None
    if placed.backend == "vllm" and not chosen_rollout.workers:  # workers start engines of their own
        from trajlab.inference.vllm import VLLMGenerator

        if not isinstance(model, str | Path):
            raise UserError("the vllm backend starts its engine from a model directory: save the model "
                            "(save_pretrained) and pass its path.")
        sampler = VLLMGenerator(model, seed=seed, max_batch_size=chosen_rollout.concurrency,
                                engine_args=None if placed.dtype == "auto" else {"dtype": placed.dtype})
    return run_rl(model, loaded, resolve_chat_template(loaded), trained_on, chosen, chosen_rollout, out, seed=seed,
                  resume=resume, on_step=on_step, sampler=sampler, device=placed.device, dtype=placed.dtype,
                  backend=placed.backend, report_to=report_to, processor=processor)


def evolve(
    env: EnvLike,
    policy: PolicyLike | Policy,
    out: str | Path,
    *,
    tokenizer: Any = None,
    rollout: RolloutSettings | Mapping[str, Any] | None = None,
    seed: int = 0,
    backend: str | None = None,
    log: Callable[[str], None] | None = None,
    device: str = "auto",
    dtype: str = "auto",
    report_to: Sequence[str] = (),
    **settings: Any,
) -> dict[str, Any]:
    """Evolve the system prompt (and chosen tool descriptions) of ``policy`` on ``env`` with GEPA.

    Writes ``out/gepa/`` (state and rollouts: calling again resumes) and ``out/result/`` (``best_candidate.json``,
    which ``rollout={"prompt_file": ...}`` rolls out with); returns the summary.

    Args:
        device, dtype: where a model-directory policy and a local reflection model are loaded, in what dtype
            (``ModelSettings``).
        report_to: experiment trackers that get each candidate's validation score and the best so far, at the
            metric calls where it was found (``evolve/...``).
        **settings: ``EvolveSettings`` fields (``reflection``, ``max_metric_calls``, ``train_tasks``...).
    """
    require("gepa", feature="trajlab evolve", install="pip install 'trajlab[evolve]'")
    from trajlab.evolution.run import evolve as run_evolution
    from trajlab.evolution.run import evolve_curve, rollouts_path
    from trajlab.tracking import Trackers, require_trackers

    require_trackers(report_to)
    chosen = _settings(EvolveSettings, settings)
    config = _collect_config(env, policy, rollouts_path(out), tokenizer=tokenizer, tasks=None, seed=seed,
                             rollout=_settings(RolloutSettings, rollout or {}), episodes=1, split="train",
                             samples_per_task=1, temperature=chosen.temperature,
                             model=_model(device, dtype, backend))
    summary = run_evolution(config, chosen, out, seed=seed, log=log)
    with Trackers(report_to, Path(out).parent, Path(out).name,
                  config={"evolve": chosen.model_dump(mode="json"), "seed": seed}) as trackers:
        for calls, values in evolve_curve(Path(out) / "result"):
            trackers.log(values, step=calls)
    return summary


def _collect_config(env: EnvLike, policy: PolicyLike | Policy, out: Path, *, tokenizer: Any,
                    tasks: Sequence[Mapping[str, Any]] | str | Path | None, seed: int, rollout: RolloutSettings,
                    episodes: int, split: str, samples_per_task: int, temperature: float,
                    model: ModelSettings, reference: str | None = None, reference_noise: float = 0.0) -> Any:
    from trajlab.inference.base import SamplingParams
    from trajlab.recipes.collect import CollectConfig

    spec, system_prompt = rollout.prompted(_env(env))
    return CollectConfig(
        env=spec, policy=policy, episodes=episodes, out=out, split=split, seed=seed,
        samples_per_task=samples_per_task, tasks_file=Path(tasks) if isinstance(tasks, str | Path) else None,
        tasks=[dict(task) for task in tasks] if tasks is not None and not isinstance(tasks, str | Path) else None,
        tokenizer=tokenizer, parser=rollout.parser, concurrency=rollout.concurrency, retries=rollout.retries,
        retry_backoff_s=rollout.retry_backoff_s, workers=rollout.workers, ray_address=rollout.ray_address,
        worker_gpus=rollout.worker_gpus,
        system_prompt=system_prompt,
        sampling=SamplingParams(temperature=temperature), limits=rollout.limit_overrides(),
        device=model.device, dtype=model.dtype, backend=model.backend, reference=reference,
        reference_noise=reference_noise,
    )


def _model(device: str, dtype: str, backend: str | None = None) -> ModelSettings:
    """``device``, ``dtype`` and ``backend`` validated as the config's ``model`` section (backend None: its
    default)."""
    return _settings(ModelSettings, {"device": device, "dtype": dtype} | ({} if backend is None else
                                                                           {"backend": backend}))


def _env(env: EnvLike) -> EnvSpec | EnvMixture:
    if isinstance(env, EnvSpec | EnvMixture):
        return env
    if isinstance(env, type):
        return EnvSpec(name=env.__name__, env_cls=env)
    if isinstance(env, str):
        return load_envs(env)
    return load_envs(list(env))


def _settings(model: type[S], given: S | Mapping[str, Any]) -> S:
    """``given`` validated as ``model`` (a built one is taken as it is); a bad or unknown key is a UserError."""
    if isinstance(given, model):
        return given
    try:
        return model.model_validate(dict(given))
    except ValidationError as exc:
        from trajlab.config import describe_errors

        raise UserError(f"invalid {model.__name__}: {describe_errors(exc, model)}") from exc


def _load_tokenizer(model: Any, tokenizer: Any) -> Any:
    from transformers import PreTrainedTokenizerBase

    from trajlab.models import load_tokenizer

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    if tokenizer is None and not isinstance(model, str | Path):
        raise UserError("a loaded model needs tokenizer=: its tokenizer or the directory holding it.")
    return load_tokenizer(tokenizer or model)


def _load_processor(model: Any, processor: Any) -> Any:
    """The processor given, else a model directory's own (None for a text model or a loaded model)."""
    from trajlab.models import load_processor

    if processor is not None or not isinstance(model, str | Path):
        return processor
    return load_processor(model)


def _label(policy: Any) -> str:
    """A policy's name in tables: oracle, a model directory's name, or a server's model (else its URL)."""
    from trajlab.inference.base import is_server_url

    if isinstance(policy, Policy):
        return policy.generator.name
    if not isinstance(policy, str | Path):
        return getattr(policy, "name", None) or type(policy).__name__
    if str(policy) == "oracle":
        return "oracle"
    if is_server_url(str(policy)):
        return str(policy).partition("#")[2] or str(policy)
    return Path(policy).name


class _output:
    """``out`` as a path, or a temporary directory removed afterwards when there is none."""

    def __init__(self, out: str | Path | None, name: str) -> None:
        self.out, self.name, self.tmp = out, name, None

    def __enter__(self) -> Path:
        if self.out is not None:
            return Path(self.out)
        self.tmp = tempfile.TemporaryDirectory(prefix="trajlab-")
        return Path(self.tmp.name) / self.name

    def __exit__(self, *exc: object) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()
