"""trajlab: post-train LLMs to use tools across many turns.

The Python API (``collect``, ``evaluate``, ``sft``, ``rl``, ``evolve``) is the recipes' (:mod:`trajlab.recipes`),
loaded on first use so ``import trajlab`` stays light.
"""

from typing import Any

from trajlab.env import Environment, EnvSpec, load_env, register
from trajlab.errors import InfrastructureError
from trajlab.rollout.check import EnvCheckError, check_env

API = ("collect", "evaluate", "sft", "rl", "evolve")
"""The Python API: each is the function of the same name in the recipe ``trajlab.recipes.<name>``."""

__all__ = ["EnvCheckError", "Environment", "EnvSpec", "InfrastructureError", "check_env", "load_env", "register", *API]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in API:
        import importlib

        return getattr(importlib.import_module(f"trajlab.recipes.{name}"), name)
    raise AttributeError(f"module 'trajlab' has no attribute {name!r}")
