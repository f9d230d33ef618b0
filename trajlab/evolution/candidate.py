"""What ``trajlab evolve`` evolves: named texts, the system prompt and optionally tool descriptions.

A candidate is GEPA's ``dict[str, str]``: ``system_prompt`` plus one ``tool:NAME`` entry per evolved tool
description. ``trajlab evolve`` writes the best one to ``result/best_candidate.json``; ``--prompt-file`` (or
``rollout.prompt_file`` in a run config) reads it back, so ``collect``, ``eval``, ``rl`` and ``run`` roll out with
exactly the evolved texts (see :mod:`trajlab.env.prompts`).
"""

from __future__ import annotations

from collections.abc import Sequence

from trajlab.env.prompts import SYSTEM_PROMPT, TOOL_PREFIX, tool_descriptions
from trajlab.env.registry import EnvSpec

TOOL_REFLECTION_TEMPLATE = """An assistant solves tasks by calling tools. This is the description it reads of the \
tool `<tool>`:
```
<curr_param>
```

Below are episodes the assistant played with that description: each task, what the assistant did (its tool calls \
with their arguments, and what the tools returned) and feedback on how well the episode went:
```
<side_info>
```

Write a new description of the tool `<tool>` that would lead the assistant to call it correctly and at the right \
moment. Keep what the tool does and what its arguments mean accurate; add what the episodes show the assistant \
misunderstood.

Give the new description within ``` blocks."""
"""GEPA's reflection template for a ``tool:NAME`` component (GEPA's default one asks for assistant instructions)."""


def seed_candidate(env: EnvSpec, system_prompt: str, tools: Sequence[str] = ()) -> dict[str, str]:
    """The starting candidate: ``system_prompt`` and the current descriptions of ``tools``.

    Raises:
        ValueError: a tool is not the env's.
    """
    described = {schema["function"]["name"]: schema["function"].get("description", "") for schema in env.tools}
    unknown = sorted(set(tools) - set(described))
    if unknown:
        raise ValueError(f"Environment '{env.name}' has no tool(s) {unknown}; its tools: {', '.join(described)}.")
    return {SYSTEM_PROMPT: system_prompt, **{f"{TOOL_PREFIX}{name}": described[name] for name in tools}}


def reflection_templates(candidate: dict[str, str]) -> dict[str, str]:
    """Per tool component, the tool-description template naming the tool; the system prompt keeps GEPA's."""
    return {f"{TOOL_PREFIX}{name}": TOOL_REFLECTION_TEMPLATE.replace("<tool>", name)
            for name in tool_descriptions(candidate)}
