"""Prompt evolution: the system prompt optimised with ``gepa`` on trajlab rollouts."""
