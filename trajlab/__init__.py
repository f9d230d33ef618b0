"""trajlab: post-train LLMs to use tools across many turns.

The Python API (``collect``, ``evaluate``, ``sft``, ``rl``, ``evolve``) is the recipes' (:mod:`trajlab.recipes`), and
``check_env`` the rollout engine's: each is loaded on first use, so ``import trajlab`` (and every ``trajlab`` command,
which imports it) stays light.
"""

from typing import Any

from trajlab.env import Environment, EnvSpec, load_env, register
from trajlab.errors import InfrastructureError

API = ("collect", "evaluate", "sft", "rl", "evolve")
"""The Python API: each is the function of the same name in the recipe ``trajlab.recipes.<name>``."""
LAZY = {name: f"trajlab.recipes.{name}" for name in API} | dict.fromkeys(("check_env", "EnvCheckError"),
                                                                          "trajlab.rollout.check")
"""The names loaded on first use, and the module of each (importing them imports transformers)."""

__all__ = ["EnvCheckError", "Environment", "EnvSpec", "InfrastructureError", "check_env", "load_env", "register", *API]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in LAZY:
        import importlib

        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'trajlab' has no attribute {name!r}")
