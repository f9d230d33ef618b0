"""Reward functions: the configured rewards of a run (:class:`RewardSet`), a function given by import path
(:class:`RewardFunction`), and an LLM judge (:class:`~trajlab.rewards.judge.LLMJudge`)."""

from trajlab.rewards.functions import RewardConfig, RewardFunction, RewardSet, Scores, load_target, weight_of
from trajlab.rewards.judge import (
    JudgeError,
    LLMJudge,
    RelativeJudge,
    parse_attempt_scores,
    parse_score,
    render_conversation,
)

__all__ = ["JudgeError", "LLMJudge", "RelativeJudge", "RewardConfig", "RewardFunction", "RewardSet", "Scores",
           "load_target", "parse_attempt_scores", "parse_score", "render_conversation", "weight_of"]
