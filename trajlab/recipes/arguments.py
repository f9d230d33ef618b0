"""What the Python API's functions take from a user, validated and built: envs given by name or class, settings as
keyword arguments or built models, and where to write.

Keyword settings are the fields of the config section of the same stage and are validated by it, so a default, a
YAML key and a keyword argument are one setting; an argument left at None takes the section's default.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from trajlab.config import ModelSettings, PipelineConfig, VLLMSettings, describe_errors
from trajlab.env.mixture import EnvMixture, load_envs
from trajlab.env.registry import EnvSpec
from trajlab.errors import UserError
from trajlab.inference.base import is_server_url
from trajlab.inference.policy import Policy, PolicyLike

EnvLike = EnvSpec | EnvMixture | type | str | Sequence[str]
"""An EnvSpec or mixture, an env class, a registered name or import path, or several names (a mixture)."""
Progress = Callable[[int, int], None]
"""``on_progress(done, total)``, called as episodes (or SFT's optimizer steps) finish."""

S = TypeVar("S", bound=BaseModel)


def settings_of(model: type[S], given: S | Mapping[str, Any] | None) -> S:
    """``given`` validated as ``model`` (a built one is taken as it is; None: its defaults); a bad or unknown key is
    a UserError."""
    if isinstance(given, model):
        return given
    try:
        return model.model_validate(dict(given or {}))
    except ValidationError as exc:
        raise UserError(f"invalid {model.__name__}: {describe_errors(exc, model)}") from exc


def model_settings(device: str | None, dtype: str | None, backend: str | None,
                   vllm: VLLMSettings | dict | None = None) -> ModelSettings:
    """``device``, ``dtype``, ``backend`` and ``vllm`` (engine arguments) validated as the config's ``model``
    section; None: its default."""
    given = {"device": device, "dtype": dtype, "backend": backend, "vllm": vllm}
    return settings_of(ModelSettings, {name: value for name, value in given.items() if value is not None})


def given_or_default(value: Any, section: type[BaseModel], name: str) -> Any:
    """``value``, else the default of ``section``'s field ``name``: an argument left at None takes the setting's
    default, which lives in the settings model only."""
    return section.model_fields[name].get_default(call_default_factory=True) if value is None else value


def run_seed(seed: int | None) -> int:
    """The run's seed: ``seed``, else the config's default (``seed``)."""
    return given_or_default(seed, PipelineConfig, "seed")


def as_env(env: EnvLike) -> EnvSpec | EnvMixture:
    """The env (or mixture) a user named, loaded."""
    if isinstance(env, EnvSpec | EnvMixture):
        return env
    if isinstance(env, type):
        return EnvSpec(name=env.__name__, env_cls=env)
    if isinstance(env, str):
        return load_envs(env)
    return load_envs(list(env))


def policy_label(policy: PolicyLike | Policy) -> str:
    """A policy's name in tables: oracle, a model directory's name, or a server's model (else its URL)."""
    if isinstance(policy, Policy):
        return policy.generator.name
    if not isinstance(policy, str | Path):
        return getattr(policy, "name", None) or type(policy).__name__
    if str(policy) == "oracle":
        return "oracle"
    if is_server_url(str(policy)):
        return str(policy).partition("#")[2] or str(policy)
    return Path(policy).name


@contextmanager
def output_path(out: str | Path | None, name: str) -> Iterator[Path]:
    """``out`` as a path, or, when there is none, ``name`` in a temporary directory removed afterwards."""
    if out is not None:
        yield Path(out)
        return
    with tempfile.TemporaryDirectory(prefix="trajlab-") as tmp:
        yield Path(tmp) / name
