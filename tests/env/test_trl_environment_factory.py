"""Every built-in env runs unchanged in TRL GRPOTrainer as ``trl_environment_factory``'s class: one step on the tiny
model. Images under TRL: test_trl_images.py."""

import contextlib
import os
from unittest import mock

import pytest

from trajlab.env import load_env
from trajlab.env.mixture import load_envs
from trajlab.env.registry import registered_names
from trajlab.env.trl import env_reward, trl_dataset, trl_environment_factory
from trajlab.models.loading import load_model, load_tokenizer

# Prompt tokens beyond which one TRL step runs on 2 episodes instead of 4: BFCL shows all of its 128 tools (about
# 14k tokens with the tiny tokenizer), and attention over them makes a 4-episode step take minutes on 2 cores.
LONG_PROMPT_TOKENS = 4096


def one_step_config(tmp_path, episodes=4):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no", max_steps=1,
        per_device_train_batch_size=episodes, num_generations=2, max_completion_length=96, logging_steps=1,
        generation_kwargs={"max_new_tokens": 16}, max_tool_calling_iterations=1, disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=False,
    )


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow(87)) if name == "bfcl" else name
                                  for name in registered_names()])
def test_env_is_a_trl_environment_factory(name, tiny_model_dir, tmp_path):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOTrainer

    spec = load_env(name)
    dataset = trl_dataset(spec, split="train", size=8, seed=0)
    scored = []

    def recording_reward(environments, **kwargs):
        scored.extend(environments)
        return env_reward(environments, **kwargs)

    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=spec.tools, tokenize=False)
    prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
    episodes = 2 if prompt_tokens > LONG_PROMPT_TOKENS else 4
    args = one_step_config(tmp_path, episodes)
    reset = spec.env_cls.reset
    factory = trl_environment_factory(spec)
    with mock.patch.object(spec.env_cls, "reset", autospec=True, side_effect=reset) as resets:
        trainer = GRPOTrainer(model=load_model(tiny_model_dir), reward_funcs=[recording_reward], args=args,
                              train_dataset=dataset, processing_class=tokenizer, environment_factory=factory)
        assert sorted(tool.__name__ for tool in trainer.tools) == sorted(t["function"]["name"] for t in spec.tools)
        trainer.train()

    assert trainer.state.global_step == 1
    assert len(scored) == episodes and all(type(env) is factory for env in scored)
    assert issubclass(factory, spec.env_cls)
    task_ids = set(dataset["task_id"])
    reset_ids = [call.kwargs.get("task_id") for call in resets.call_args_list]
    assert len(reset_ids) >= episodes and set(reset_ids) <= task_ids, "TRL resets each episode's env with its row"


def test_a_mixture_is_a_trl_dict_environment_factory_routed_by_its_environment_column(tiny_model_dir, tmp_path):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOTrainer

    mixture = load_envs("arithmetic,wordle")
    dataset = trl_dataset(mixture, split="train", size=8, seed=0)
    assert dataset["environment"][:4] == ["arithmetic", "wordle", "arithmetic", "wordle"]
    scored = []

    def recording_reward(environments, **kwargs):
        scored.extend(environments)
        return env_reward(environments, **kwargs)

    factories = trl_environment_factory(mixture)
    assert factories == {name: trl_environment_factory(mixture.specs[name]) for name in ("arithmetic", "wordle")}
    with contextlib.ExitStack() as stack:
        resets = {name: stack.enter_context(mock.patch.object(spec.env_cls, "reset", autospec=True,
                                                              side_effect=spec.env_cls.reset))
                  for name, spec in mixture.specs.items()}
        trainer = GRPOTrainer(model=load_model(tiny_model_dir), reward_funcs=[recording_reward],
                              args=one_step_config(tmp_path), train_dataset=dataset,
                              processing_class=load_tokenizer(tiny_model_dir), environment_factory=factories)
        trainer.train()

    assert trainer.state.global_step == 1
    assert {type(env) for env in scored} == set(factories.values()), "both envs ran in the one step"
    for name, reset in resets.items():
        rows = [call.kwargs for call in reset.call_args_list]
        assert rows and all(row["env"] == name for row in rows), f"{name} was reset only with its own rows"
