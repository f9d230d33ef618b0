"""Handing the trained weights to what samples: a copy of the policy takes them in place; a sampler with weights of
its own sleeps through the update, wakes, then takes them; the model that samples itself needs nothing."""

import torch

from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.train.publish import publish, synced_sampler


class RecordingSampler:
    """A sampler with weights of its own (the :class:`TakesWeights` protocol, as vLLM and rollout workers have it),
    recording what it is asked to do."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, model: torch.nn.Module) -> None:
        self.calls.append("load_weights")
        self.weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake_up(self) -> None:
        self.calls.append("wake_up")


def test_a_sampler_with_weights_of_its_own_sleeps_through_the_update_then_takes_the_new_weights(tiny_model_dir):
    model, sampler = load_model(tiny_model_dir, device="cpu"), RecordingSampler()
    with synced_sampler(sampler, model):
        assert sampler.calls == ["sleep"]
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)  # the update
    assert sampler.calls == ["sleep", "wake_up", "load_weights"]
    assert torch.equal(sampler.weights["model.norm.weight"], model.model.norm.weight)

    publish(sampler, None, model)  # asynchronous RL, between two steps' rollouts
    assert sampler.calls[-1] == "load_weights"


def test_a_behaviour_copy_takes_the_weights_in_place_and_the_policy_itself_needs_nothing(tiny_model_dir):
    model, behaviour = load_model(tiny_model_dir, device="cpu"), load_model(tiny_model_dir, device="cpu")
    kept = behaviour.model.norm.weight
    with torch.no_grad():
        model.model.norm.weight.mul_(0.5)
    publish(HFGenerator(behaviour, load_tokenizer(tiny_model_dir), max_batch_size=8), behaviour, model)
    assert behaviour.model.norm.weight is kept and torch.equal(kept, model.model.norm.weight), "copied in place"
    assert all(torch.equal(a, b) for a, b in zip(behaviour.parameters(), model.parameters(), strict=True))

    on_policy = HFGenerator(model, load_tokenizer(tiny_model_dir), max_batch_size=8)
    before = model.model.norm.weight.clone()
    with synced_sampler(on_policy, model):  # the hf generator samples from the trained model: nothing to hand over
        pass
    publish(on_policy, None, model)
    assert torch.equal(model.model.norm.weight, before)
