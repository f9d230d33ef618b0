"""Which reference policy demonstrates when the policy is ``oracle``: the env's own, one of its named imperfect ones
(``collect.reference``), or either erring on purpose in a share of its situations (``collect.reference_noise``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajlab.env.mixture import EnvMixture
from trajlab.env.noisy import NoisyReference
from trajlab.env.registry import EnvSpec, Oracle
from trajlab.errors import UserError
from trajlab.inference.policy import Policy, PolicyLike
from trajlab.inference.scripted import draws
from trajlab.rollout.types import Trajectory


@dataclass(frozen=True)
class Demonstrator:
    """A reference policy and the name its trajectories record as their policy (``oracle``, ``oracle:NAME``,
    ``NAME+noiseP``); ``noisy`` is set when it errs on purpose, so each trajectory can record its mistakes."""

    reference: Oracle | None
    name: str
    noisy: NoisyReference | None = None

    def record_noise(self, trajectory: Trajectory) -> None:
        """Mark a noisy reference's trajectory: ``metrics["reference_noise"]`` (the share of situations it errs in)
        and ``metrics["reference_noise/turns"]`` (its turns that were mistakes; 0: the demonstration is the
        reference's own)."""
        if self.noisy is None:
            return
        trajectory.metrics["reference_noise"] = self.noisy.noise
        trajectory.metrics["reference_noise/turns"] = float(len(self.noisy.erred_turns(trajectory.task,
                                                                                        trajectory.messages)))


def is_oracle(policy: PolicyLike | Policy) -> bool:
    return isinstance(policy, str | Path) and str(policy) == "oracle"


def demonstrator(env: EnvSpec | EnvMixture, policy: PolicyLike | Policy, *, reference: str | None, noise: float,
                 seed: int) -> Demonstrator | None:
    """The reference policy that demonstrates for ``policy`` (None unless it is ``oracle``): ``reference`` names one
    of the env's imperfect ones (None: its own), and ``noise`` makes it err in that share of its situations, seeded
    by ``seed``.

    Raises:
        UserError: a named reference or noise for a policy other than the oracle, a reference the env does not have,
            or noise with a reference that draws anew in every episode.
    """
    if not is_oracle(policy):
        if reference or noise:
            raise UserError(f"collect.reference and reference_noise make the env's reference policy demonstrate, which "
                            f"needs --policy oracle, not {policy!r}.")
        return None
    oracle, name = (named_reference(env, reference), f"oracle:{reference}") if reference else (env.oracle, "oracle")
    if not noise:
        return Demonstrator(oracle, name)
    if oracle is None:
        raise UserError(f"reference_noise makes the env's reference policy err, and {env.name} has none.")
    if draws(oracle):
        raise UserError(f"reference_noise replays each conversation to find the turns its reference erred on, and the "
                        f"reference {reference!r} draws anew in every episode, so they do not compose: leave "
                        f"collect.reference_noise at 0 with it.")

    def tools_of(task: dict[str, Any]) -> list[dict[str, Any]]:
        return (env.spec_for(task) if isinstance(env, EnvMixture) else env).tools

    noisy = NoisyReference(oracle, tools_of, noise, seed=seed, name=name)
    return Demonstrator(noisy, noisy.name, noisy)


def named_reference(env: EnvSpec | EnvMixture, name: str) -> Oracle:
    """The env's imperfect reference policy ``name``.

    Raises:
        UserError: a mixture of envs, or a name the env does not have (the message lists those it has).
    """
    if isinstance(env, EnvMixture):
        raise UserError(f"collect.reference {name!r} is one env's: collect each env of the mixture {env.name!r} on "
                        "its own to use it.")
    if name not in env.references:
        listed = ", ".join(sorted(env.references)) or "none besides its own"
        raise UserError(f"{env.name} has no reference policy {name!r}; it has: {listed}. Leave collect.reference "
                        "unset for the env's own.")
    return env.references[name]
