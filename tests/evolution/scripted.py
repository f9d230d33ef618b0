"""TEST-ONLY scripted parts for prompt evolution; none of them ships with trajlab.

- ``InstructionFollowingPolicy``: an arithmetic policy that plays like the reference policy but submits the result
  + 1 unless its system prompt tells it to double-check.
- ``deterministic_proposer``: a reflection "LM" that reads GEPA's reflection prompt and appends that instruction to
  the current text when the episodes it is shown submitted wrong answers.
- ``INSTRUCTED``: the arithmetic env with that policy as its ``oracle``, so ``--policy oracle`` on the command line
  is a policy that really reacts to the prompt (``--env tests.evolution.scripted:INSTRUCTED``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trajlab.env.builtin.arithmetic import SPEC as ARITHMETIC
from trajlab.env.builtin.arithmetic import oracle

SEED_PROMPT = "You solve arithmetic with the calculator tools."
HINT = "Double-check: submit exactly the last tool result."


class InstructionFollowingPolicy:
    """TEST-ONLY scripted policy: solves like the oracle but, unless told to double-check, submits the result + 1."""

    hint = "double-check"

    def __call__(self, task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        message = oracle(task, messages)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        call = message["tool_calls"][0]["function"]
        if call["name"] == "submit" and self.hint not in system.lower():
            call["arguments"] = {"answer": call["arguments"]["answer"] + 1}
        return message


def deterministic_proposer(prompt: str) -> str:
    """TEST-ONLY reflection LM: reads GEPA's reflection prompt and fixes the text when submits were wrong."""
    current = prompt.split("```")[1].strip()  # GEPA's templates put the current text in the first block
    if "-> submit: Wrong." in prompt and HINT not in current:
        return f"```\n{current} {HINT}\n```"
    return f"```\n{current}\n```"


def proposer_as_chat_policy(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """TEST-ONLY: ``deterministic_proposer`` as a scripted chat policy, to serve it over ``trajlab serve``'s app."""
    return {"role": "assistant", "content": deterministic_proposer(messages[-1]["content"])}


INSTRUCTED = replace(ARITHMETIC, name="arithmetic-instructed", oracle=InstructionFollowingPolicy(),
                     system_prompt=SEED_PROMPT)
