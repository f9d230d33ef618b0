"""The whole run's config (``PipelineConfig``: every section), read from YAML with overrides and validated; every
problem said in one line, an unknown key with the closest valid one."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError

from trajlab.config.curriculum import CurriculumSettings
from trajlab.config.mcp import McpSettings
from trajlab.config.sections import (
    CollectSettings,
    ConfigError,
    DatasetSettings,
    EvalSettings,
    EvolveSettings,
    ModelSettings,
    RLSettings,
    RolloutSettings,
    Section,
    ServeSettings,
    SFTSettings,
)
from trajlab.config.tasks import TasksSettings
from trajlab.env.mixture import EnvMixture, load_envs
from trajlab.env.registry import EnvSpec
from trajlab.errors import refuse_special_file
from trajlab.tracking import TrackerName

Stage = Literal["collect", "sft", "eval", "rl", "evolve"]


class PipelineConfig(Section):
    """The whole pipeline: collect demonstrations -> dataset -> SFT -> eval -> RL -> eval, and optionally evolve."""

    run_dir: str = "runs/run"
    """Where every stage writes its results; re-running resumes from them."""
    env: str | list[str] | None = None
    """A registered env name or import path; a list (or comma-separated names) mixes envs in one run. Every stage
    but sft needs one."""
    difficulty: dict[str, int] = Field(default_factory=dict)
    """Difficulty knobs of the env (``trajlab envs`` lists each env's), e.g. ``{max_operand: 20}``; in a mixture each
    knob goes to the envs that have it. Every stage uses them except RL under a curriculum (its stages set theirs)."""
    tasks: TasksSettings | None = None
    """Tasks from a dataset (a file, a ``datasets`` folder or a cached dataset name) instead of the env's generator,
    in every stage that draws tasks; None: the env's own."""
    seed: int = 0
    """Training seed (and task order of the collect and RL stages)."""
    report_to: list[TrackerName] = Field(default_factory=list)
    """Experiment trackers that also get every stage's metrics (sft, rl, eval, evolve): any of tensorboard, wandb,
    trackio, mlflow, each in its offline or local mode unless its own settings say otherwise (docs/metrics.md)."""
    stages: list[Stage] = Field(default_factory=lambda: ["collect", "sft", "eval", "rl", "eval"])
    """Stages run in order: collect, sft, eval, rl, evolve (eval may repeat)."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """The starting model."""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """How episodes are rolled out in every stage."""
    collect: CollectSettings = Field(default_factory=CollectSettings)
    """The collect stage (and `trajlab collect`)."""
    dataset: DatasetSettings = Field(default_factory=DatasetSettings)
    """Turning demonstrations into the SFT dataset."""
    sft: SFTSettings = Field(default_factory=SFTSettings)
    """Supervised fine-tuning."""
    rl: RLSettings = Field(default_factory=RLSettings)
    """Online multi-turn RL."""
    eval: EvalSettings = Field(default_factory=EvalSettings)
    """Every eval stage (and `trajlab eval`)."""
    evolve: EvolveSettings = Field(default_factory=EvolveSettings)
    """Prompt evolution with GEPA."""
    serve: ServeSettings = Field(default_factory=ServeSettings)
    """`trajlab serve`: the recording server."""
    curriculum: CurriculumSettings | None = None
    """RL in stages (tasks, difficulty, limits and env mixture of each, and when to move on); None: RL on the run's
    env throughout."""
    mcp: McpSettings | None = None
    """The MCP server whose tools are the env of ``env: mcp`` (docs/mcp.md)."""

    def env_spec(self) -> EnvSpec | EnvMixture:
        """The configured env (or mixture), loaded, at the configured difficulty or drawing the configured tasks.

        Raises:
            ConfigError: no env is configured, or both difficulty and tasks are.
            FileNotFoundError, ValueError: the tasks' source, mapping, splits or rows are wrong.
        """
        if self.env is None:
            raise ConfigError("no env: give --env, or a --config naming one (or --set env=NAME).")
        if self.env == "mcp":
            if self.mcp is None:
                raise ConfigError("env: mcp needs an mcp: section naming the server: mcp.command (a stdio server's "
                                  "argv) or mcp.url (a streamable-HTTP endpoint), e.g. --set 'mcp.command=[python3, "
                                  "server.py]'.")
            env = self.mcp.spec()
        else:
            env = load_envs(self.env)
        if self.tasks is not None:
            if self.difficulty:
                raise ConfigError("difficulty sets the env's task generator, which tasks replaces: remove one of "
                                  "them.")
            return self.tasks.apply(env)
        return env.with_options(**self.difficulty) if self.difficulty else env


def load_config(path: str | Path | None, overrides: dict | None = None) -> PipelineConfig:
    """Read and validate a YAML config; ``overrides`` (nested dicts, e.g. from ``--set``) replace values from the file
    (or, with no file, are the whole config). Every ``--config`` of every command goes through here.

    Raises:
        ConfigError: the file is missing or not YAML, or a section or key is unknown or invalid (each named, with
            the closest valid name).
    """
    data, source = {}, "the command's options"
    if path is not None:
        path = source = Path(path)
        refuse_special_file(path, "a config file (YAML)")  # a FIFO would block the read, a device never end it
        try:
            data = read_yaml(path.read_text()) or {}
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ConfigError(f"{path}: no such config file") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                              "a config is a YAML file in UTF-8") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a config is a mapping of sections, got {type(data).__name__}")
    _merge(data, overrides or {})
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config: {describe_errors(exc)}") from exc


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently; YAML
    says keys are unique). PyYAML has no option for it; its constructor is the documented place to add one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: explicit keys may override merged ones
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base constructor says so
                continue
            if seen is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first at line {seen.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(text: str) -> Any:
    """YAML text as data, as ``yaml.safe_load`` reads it except that a key given twice in a mapping is an error.

    Raises:
        yaml.YAMLError: the text is not YAML, or repeats a key (the problem's mark gives the line).
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)


def _merge(base: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's problem and its line and column, in one line (its own message spans several, with a caret)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def describe_errors(error: ValidationError, root: type[BaseModel] = PipelineConfig) -> str:
    """Every problem in one line, "; "-separated: where it is, what is wrong; an unknown key names the closest valid
    one."""
    return "; ".join(_describe(item, root) for item in error.errors())


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """The models an annotation holds, however deep (``list[X]``, ``dict[str, float | X]``, ``Annotated[...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def _describe(error: Any, root: type[BaseModel]) -> str:
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] != "extra_forbidden":
        message = error["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
        return f"{where}: {message}"
    section: type[BaseModel] = root
    for part in error["loc"][:-1]:
        if str(part) not in section.model_fields:  # a list's index, a dict's key: the model is the field's
            continue
        section = next(_models_in(section.model_fields[str(part)].annotation), section)
    close = difflib.get_close_matches(str(error["loc"][-1]), list(section.model_fields), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{where}: unknown key{hint} (valid keys here: {', '.join(section.model_fields)})"
