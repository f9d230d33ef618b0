"""The settings of every stage: one pydantic model per config section, unknown keys are errors.

Each setting (name, type, default, help text) is written here once: the sections in ``sections`` (and
``curriculum``), the whole run's config and its loading in ``pipeline``. A YAML config, ``trajlab`` command-line
options (``--max-turns``, ``--set rollout.max_turns=4``) and the Python API (``trajlab.evaluate(..., num_tasks=50)``)
are three views of the same fields, all validated by these models, so ``trajlab eval`` and the ``eval`` stage of
``trajlab run`` measure the same thing by default. A misspelled section or key fails validation with its path and
the closest valid name, instead of silently falling back to a default.
"""

from trajlab.config.curriculum import CurriculumSettings, PromoteRule, StageSettings
from trajlab.config.mcp import McpSettings
from trajlab.config.pipeline import PipelineConfig, Stage, describe_errors, load_config
from trajlab.config.sections import (
    CollectSettings,
    ConfigError,
    DatasetSettings,
    EvalSettings,
    EvolveSettings,
    LimitSettings,
    LoraSettings,
    ModelSettings,
    RewardWeights,
    RLSettings,
    RolloutSettings,
    Section,
    ServeSettings,
    SFTSettings,
    TrainingSettings,
    VLLMSettings,
)
from trajlab.config.tasks import TasksSettings

__all__ = [
    "CollectSettings", "ConfigError", "CurriculumSettings", "DatasetSettings", "EvalSettings", "EvolveSettings",
    "LimitSettings", "LoraSettings", "McpSettings", "ModelSettings", "PipelineConfig", "PromoteRule", "RLSettings",
    "RewardWeights", "RolloutSettings", "SFTSettings", "Section", "ServeSettings", "Stage", "StageSettings",
    "TasksSettings",
    "TrainingSettings", "VLLMSettings", "describe_errors", "load_config",
]
