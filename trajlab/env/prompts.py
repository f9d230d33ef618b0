"""The texts an episode shows instead of the env's own: a system prompt and tool descriptions.

``trajlab evolve`` writes them as ``result/best_candidate.json`` (``system_prompt`` plus one ``tool:NAME`` entry per
evolved tool description); ``--prompt-file`` (or ``rollout.prompt_file`` in a run config) reads such a file back, so
``collect``, ``eval``, ``rl`` and ``run`` roll out with exactly those texts. A plain text file is read as the system
prompt. This lives with the envs because it only changes what an env's episodes show, never the tools themselves.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from trajlab.env.base import tool_names
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.errors import refuse_special_file

SYSTEM_PROMPT = "system_prompt"
TOOL_PREFIX = "tool:"


def tool_descriptions(candidate: dict[str, str]) -> dict[str, str]:
    return {key.removeprefix(TOOL_PREFIX): text for key, text in candidate.items() if key.startswith(TOOL_PREFIX)}


def read_prompt_file(path: str | Path) -> dict[str, str]:
    """A candidate from ``best_candidate.json`` (or any ``.json`` of that shape), or a text file's system prompt.

    Raises:
        ValueError: the file is missing, or a JSON file is not an object of texts keyed by component names.
    """
    path = Path(path)
    refuse_special_file(path, "a prompt file (best_candidate.json or a text file)")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"Prompt file {path}: {exc.strerror or exc}.") from exc
    if path.suffix != ".json":
        return {SYSTEM_PROMPT: text}
    try:
        candidate = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Prompt file {path}: not valid JSON ({exc.msg}).") from exc
    if not isinstance(candidate, dict) or not all(isinstance(v, str) for v in candidate.values()):
        raise ValueError(f"Prompt file {path}: expected a JSON object of texts, like trajlab evolve's "
                         "result/best_candidate.json.")
    bad = sorted(key for key in candidate if key != SYSTEM_PROMPT and not key.startswith(TOOL_PREFIX))
    if bad:
        raise ValueError(f"Prompt file {path}: unknown key(s) {bad}; keys are '{SYSTEM_PROMPT}' and "
                         f"'{TOOL_PREFIX}NAME' (a tool's description).")
    return candidate


def apply_candidate(env: EnvSpec | EnvMixture, candidate: dict[str, str]) -> EnvSpec | EnvMixture:
    """``env`` with the candidate's tool descriptions (in a mixture, each goes to the env that has that tool).

    Raises:
        ValueError: a described tool belongs to no env.
    """
    descriptions = tool_descriptions(candidate)
    if not descriptions:
        return env
    if isinstance(env, EnvSpec):
        return env.with_tool_descriptions(descriptions)
    specs, placed = {}, set()
    for name, spec in env.specs.items():
        own = {tool: text for tool, text in descriptions.items() if tool in tool_names(spec.env_cls)}
        specs[name] = spec.with_tool_descriptions(own) if own else spec
        placed |= set(own)
    if set(descriptions) - placed:
        raise ValueError(f"No env of {env.name} has tool(s) {sorted(set(descriptions) - placed)}.")
    return replace(env, specs=specs)


def check_prompt_sources(system_prompt: str | None, prompt_file: str | Path | None) -> None:
    if system_prompt is not None and prompt_file is not None:
        raise ValueError("Give a system prompt (--system-prompt, rollout.system_prompt) or a prompt file "
                         "(--prompt-file, rollout.prompt_file), not both.")


def prompted(env: EnvSpec | EnvMixture, system_prompt: str | None,
             prompt_file: str | Path | None) -> tuple[EnvSpec | EnvMixture, str | None]:
    """The env and system prompt to roll out with: a prompt file's texts, else ``system_prompt`` (None: the env's).

    Raises:
        ValueError: both are given, or the prompt file is bad.
    """
    check_prompt_sources(system_prompt, prompt_file)
    if prompt_file is None:
        return env, system_prompt
    candidate = read_prompt_file(prompt_file)
    return apply_candidate(env, candidate), candidate.get(SYSTEM_PROMPT)


def prompt_tag(system_prompt: str | None, env: EnvSpec | EnvMixture) -> str:
    """A short hash of the texts an episode is shown instead of the env's own ("" when none are replaced).

    Collection episode ids carry it, so evaluating another prompt into the same file runs new episodes instead
    of reusing the ones rolled out with the old prompt.
    """
    specs = env.specs.values() if isinstance(env, EnvMixture) else [env]
    replaced = {"system_prompt": system_prompt,
                "tools": {spec.name: spec.tool_descriptions for spec in specs if spec.tool_descriptions}}
    if system_prompt is None and not replaced["tools"]:
        return ""
    return hashlib.sha256(json.dumps(replaced, sort_keys=True).encode()).hexdigest()[:10]
