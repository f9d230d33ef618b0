"""Episode limits: what an env's episodes need by default, and what the user may set instead.

An env (its :class:`~trajlab.env.registry.EnvSpec`) states its defaults, because only the env knows how long its
episodes are (a BFCL conversation needs ~16 turns and 80k tokens; arithmetic needs 4 turns). The engine applies the
limits the same way to every env and records the one that ended an episode as its stop reason.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EpisodeLimits(BaseModel):
    """Turn, token and tool-time limits of one episode."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    max_turns: int = Field(8, ge=1)
    """Model turns per episode."""
    max_episode_tokens: int = Field(2048, ge=16)
    """Prompt + completion tokens per episode."""
    max_new_tokens: int = Field(128, ge=1)
    """Tokens the model may generate in one turn."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Seconds one tool call may take."""

    def override(self, **values: int | float | None) -> EpisodeLimits:
        """These limits with the given values replaced; None keeps this one's (the user did not set it)."""
        given = {key: value for key, value in values.items() if value is not None}
        return EpisodeLimits.model_validate({**self.model_dump(), **given})
