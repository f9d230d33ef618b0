"""The ``curriculum:`` section: RL in ordered stages, each with its tasks, difficulty, limits and a rule for moving
on (``trajlab.train.curriculum`` runs it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from trajlab.config.sections import ConfigError, LimitSettings, Section
from trajlab.env.mixture import EnvMixture, load_envs
from trajlab.env.registry import EnvSpec


class PromoteRule(Section):
    """When a curriculum stage hands over to the next one: after a number of RL steps, or once a success rate reaches
    a threshold (``{steps: N}``, ``{metric: train_success, window: W, threshold: T}`` or ``{metric: heldout_success,
    every: K, tasks: N, threshold: T}``)."""

    steps: int | None = Field(None, ge=1)
    """Promote after this many RL steps in the stage."""
    metric: Literal["train_success", "heldout_success"] | None = None
    """train_success: the success rate of the stage's rollouts over its last ``window`` steps; heldout_success: the
    greedy success rate on the stage's first ``tasks`` held-out tasks (validation split, else test; seed 0; the
    stage's difficulty, filter and limits), measured every ``every`` steps of the stage."""
    threshold: float | None = Field(None, ge=0, le=1)
    """Promote once the metric reaches this (a success rate, 0 to 1)."""
    window: int = Field(5, ge=1)
    """train_success: steps of the stage averaged (promotion waits until the stage has run this many)."""
    every: int = Field(5, ge=1)
    """heldout_success: steps of the stage between two held-out evaluations."""
    tasks: int = Field(20, ge=1)
    """heldout_success: held-out tasks per evaluation."""

    @model_validator(mode="after")
    def _one_rule(self) -> PromoteRule:
        # a field at its default counts as not given: a dumped rule (trajlab config show) holds every field
        fields = PromoteRule.model_fields
        given = {name for name in self.model_fields_set if getattr(self, name) != fields[name].default}
        if (self.steps is None) == (self.metric is None):
            raise ValueError("a promote rule is either {steps: N} or {metric: train_success | heldout_success, "
                             "threshold: T, ...}")
        if self.metric is not None and self.threshold is None:
            raise ValueError(f"metric {self.metric} needs a threshold (a success rate, 0 to 1)")
        own = {None: {"steps"}, "train_success": {"metric", "threshold", "window"},
               "heldout_success": {"metric", "threshold", "every", "tasks"}}[self.metric]
        if stray := sorted(given - own):
            rule = "steps" if self.metric is None else self.metric
            raise ValueError(f"a {rule} rule takes {', '.join(sorted(own))}, not {', '.join(stray)}")
        return self


class StageSettings(LimitSettings):
    """One stage of a curriculum: which tasks RL draws, with what limits, until its promote rule says to move on. The
    limits (max_turns...) override ``rollout``'s in this stage."""

    name: str
    """The stage's name in logs and ``curriculum.jsonl``."""
    env: str | list[str] | dict[str, Annotated[float, Field(gt=0)]] | None = None
    """The env (a name), a mixture (names, or names with weights: ``{arithmetic: 3, guess: 1}`` draws 3 arithmetic
    tasks per guess task); None: the run's env."""
    difficulty: dict[str, int] = Field(default_factory=dict)
    """Difficulty knobs of the stage's env(s) (``trajlab envs`` lists them); a knob left out is at its default, not at
    the run's ``difficulty``."""
    task_filter: dict[str, Any] | None = None
    """Only train tasks whose fields have these values (a list: any of its items), e.g. ``{kind: encoding}``."""
    promote: PromoteRule | None = None
    """When to move to the next stage; the last stage has none and runs until ``rl.steps``."""

    def env_spec(self, run_env: EnvSpec | EnvMixture) -> EnvSpec | EnvMixture:
        """The stage's env or mixture (``run_env`` unless it names its own) at the stage's difficulty.

        Raises:
            ConfigError: an unknown env, weights for one env, or a bad knob (each named with the stage).
        """
        try:
            env = run_env if self.env is None else load_envs(list(self.env) if isinstance(self.env, dict) else self.env)
            if isinstance(self.env, dict):
                if not isinstance(env, EnvMixture):
                    raise ValueError("weights share the steps between several envs: name one env as env: NAME")
                env = replace(env, weights=dict(self.env))
            return env.with_options(**self.difficulty)
        except ValueError as exc:
            raise ConfigError(f"curriculum stage '{self.name}': {exc}") from exc


class CurriculumSettings(Section):
    """RL in ordered stages, e.g. easy tasks first: each step draws its tasks from the current stage, and a stage's
    promote rule moves training on to the next one."""

    stages: list[StageSettings] = Field(min_length=1)
    """The stages, in order; every stage but the last has a promote rule."""

    @model_validator(mode="after")
    def _promotions(self) -> CurriculumSettings:
        names = [stage.name for stage in self.stages]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"stage names must be unique; repeated: {', '.join(repeated)}")
        if missing := [stage.name for stage in self.stages[:-1] if stage.promote is None]:
            raise ValueError(f"every stage but the last needs a promote rule (only the last runs until rl.steps); "
                             f"none in: {', '.join(missing)}")
        if self.stages[-1].promote is not None:
            raise ValueError(f"the last stage ({self.stages[-1].name}) runs until rl.steps: it has no promote rule")
        return self
