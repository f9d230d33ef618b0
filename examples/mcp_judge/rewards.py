"""The example's own reward function, named in config.yaml by import path (``examples.mcp_judge.rewards:brevity``)."""

from __future__ import annotations

from typing import Any

from trajlab.rollout.types import Trajectory


def brevity(trajectory: Trajectory, task: dict[str, Any], max_words: int = 4) -> float:
    """1 for a final answer of at most ``max_words`` words, ``max_words / words`` for a longer one, 0 for none: the
    tasks ask for the number only."""
    finals = [m for m in trajectory.messages if m.get("role") == "assistant" and not m.get("tool_calls")]
    text = finals[-1].get("content") if finals else None
    words = len(text.split()) if isinstance(text, str) else 0
    return 0.0 if words == 0 else min(1.0, max_words / words)
