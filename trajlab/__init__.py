"""trajlab: post-train LLMs to use tools across many turns."""

from trajlab.env import Environment, EnvSpec, load_env, register

__all__ = ["Environment", "EnvSpec", "load_env", "register"]
__version__ = "0.1.0"
