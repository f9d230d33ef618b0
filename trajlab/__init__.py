"""trajlab: post-train LLMs to use tools across many turns."""

from trajlab.env import Environment, EnvSpec, load_env, register
from trajlab.rollout.check import EnvCheckError, check_env

__all__ = ["EnvCheckError", "Environment", "EnvSpec", "check_env", "load_env", "register"]
__version__ = "0.1.0"
