"""How an episode's tokens are kept: one growing sequence, or one training sample per model turn.

A prefix-preserving template lets the engine append each turn's tokens to one sequence: the whole episode is one
sample. A template that rewrites history (gpt-oss dropping earlier reasoning, Mistral moving the tool list before the
last user message) makes that sequence differ from any rendering of the conversation. Such episodes are kept as
*branches*, one per model turn: the template's fresh rendering of the conversation so far as the prompt, the turn's
tokens as the completion (as prime-rl and verifiers train them). Every consumer that trains on tokens reads an
episode's samples through :func:`turn_samples`.
"""

from __future__ import annotations

from trajlab.chat.template import ChatTemplate, Message
from trajlab.rollout.types import TokenRecord, Trajectory


class SequenceTokens:
    """One sequence: prompt, then each turn's tokens and the observations' tokens after them."""

    branching = False

    def __init__(self, prompt_ids: list[int]) -> None:
        self.tokens = TokenRecord(prompt_ids=prompt_ids, completion_ids=[], loss_mask=[], logprobs=[])

    def context(self, chat: ChatTemplate, messages: list[Message]) -> list[int]:
        """The ids the model continues from."""
        return self.tokens.prompt_ids + self.tokens.completion_ids

    def add_model(self, ids: list[int], logprobs: list[float | None] | None) -> None:
        self.tokens.extend(ids, trained=True, logprobs=logprobs)

    def add_closing(self, chat: ChatTemplate, messages: list[Message]) -> None:
        self.tokens.extend(chat.closing_ids(messages), trained=False)

    def add_observation(self, chat: ChatTemplate, messages: list[Message], new: list[Message], *,
                        add_generation_prompt: bool) -> None:
        self.tokens.extend(chat.observation_ids(messages, new, add_generation_prompt=add_generation_prompt),
                           trained=False)


class TurnBranches:
    """One sample per model turn: the fresh rendering of the conversation so far, then the turn's tokens."""

    branching = True

    def __init__(self) -> None:
        self.branches: list[TokenRecord] = []
        self._prompt: list[int] = []

    def context(self, chat: ChatTemplate, messages: list[Message]) -> list[int]:
        self._prompt = chat.prompt_ids(messages)
        return self._prompt

    def add_model(self, ids: list[int], logprobs: list[float | None] | None) -> None:
        self.branches.append(TokenRecord(prompt_ids=self._prompt, completion_ids=list(ids), loss_mask=[1] * len(ids),
                                         logprobs=list(logprobs) if logprobs is not None else [None] * len(ids)))

    def add_closing(self, chat: ChatTemplate, messages: list[Message]) -> None:
        """Nothing: the next branch's prompt is rendered afresh, and no branch follows the last turn."""

    def add_observation(self, chat: ChatTemplate, messages: list[Message], new: list[Message], *,
                        add_generation_prompt: bool) -> None:
        """Nothing: the next turn's prompt renders the observations with everything before them."""


def turn_samples(trajectory: Trajectory) -> list[Trajectory]:
    """The trajectory as training samples: itself, or one per branch (id ``<id>#turn<k>``, that turn's reward)."""
    if trajectory.branches is None:
        return [trajectory]
    rewards = trajectory.turn_rewards
    return [trajectory.model_copy(update={
        "id": f"{trajectory.id}#turn{k}", "tokens": branch, "branches": None,
        "turn_rewards": [rewards[k]] if rewards is not None and k < len(rewards) else None})
        for k, branch in enumerate(trajectory.branches)]


def split_advantages(trajectory: Trajectory, advantages: list[float]) -> list[list[float]]:
    """A trajectory's token advantages (its samples' one after another) cut into one list per sample."""
    if trajectory.branches is None:
        return [advantages]
    out, at = [], 0
    for branch in trajectory.branches:
        out.append(advantages[at : at + len(branch.completion_ids)])
        at += len(branch.completion_ids)
    return out


def expand(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Every trajectory's training samples, in order."""
    return [sample for trajectory in trajectories for sample in turn_samples(trajectory)]
