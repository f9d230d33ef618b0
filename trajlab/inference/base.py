"""The Generator protocol: token ids in, token ids and logprobs out.

Every backend (transformers, an OpenAI-compatible server, vLLM, a scripted policy) implements this one method, so
the rollout engine never knows which one it drives. Requests also carry the conversation as messages, for
backends that act on messages rather than tokens (scripted policies, text-only servers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Batching = Literal["continuous", "lockstep"]
DEFAULT_BATCHING: Batching = "continuous"
"""How the vllm backend hands episodes' turns to its engine unless told otherwise (``model.vllm.batching``)."""
DEFAULT_SERVER_TIMEOUT_S = 600.0
"""The most one model turn may take on an OpenAI-compatible server unless told otherwise
(``rollout.server_timeout_s``)."""


def is_server_url(spec: str) -> bool:
    """Whether a ``--policy``/``--reflection`` value names an OpenAI-compatible server rather than a directory."""
    return str(spec).startswith(("http://", "https://"))


def request_seed(seed: int, episode_id: str, turn: int) -> int:
    """The random stream of one episode's turn: a stable function of the run's seed, the episode and the turn (the
    same in every process and run; Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(f"{seed}\x00{episode_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one assistant turn."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    task: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    """The turn's random stream (:func:`request_seed`): backends that can seed per request sample the same
    tokens for the same seed, whatever else they serve at the time. None: the backend's own randomness."""
    images: list[Any] = field(default_factory=list)
    """The PIL images whose placeholder tokens ``prompt_ids`` holds, in order (a vision-language model's input)."""


@dataclass
class GenerationResult:
    """The generated tokens, ending with the stop token when ``finish_reason == "stop"``.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution it was sampled from
    (``log_softmax`` of logits / temperature after top-k/top-p truncation, renormalised; the model's own
    ``log_softmax(logits)`` for greedy turns), or None when the backend cannot know it.
    ``text_only`` says the ids are not the ones the model produced but its reply text re-tokenized (a server that
    returns no token ids); the engine marks such trajectories ``metrics["text_only"] = 1.0``.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    finish_reason: Literal["stop", "length"]
    text_only: bool = False

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")


class Generator(Protocol):
    """A policy that continues a token prompt."""

    name: str

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...


@runtime_checkable
class TakesWeights(Protocol):
    """Samples with weights of its own (an in-process vLLM engine, Ray rollout workers): RL hands it the trainer's
    weights after every optimizer step, and lets it free its memory during the update."""

    def load_weights(self, model: Any) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

