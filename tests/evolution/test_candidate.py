"""Evolved texts as files: reading them back, applying them to envs and mixtures, and naming episodes by them."""

from __future__ import annotations

import asyncio
import json

import pytest

from trajlab.chat.parsers import get_parser
from trajlab.env.builtin.arithmetic import SPEC as ARITHMETIC
from trajlab.env.mixture import load_envs
from trajlab.env.prompts import apply_candidate, prompt_tag, prompted, read_prompt_file
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


def described(env, tool: str) -> str:
    return next(t["function"]["description"] for t in env.tools if t["function"]["name"] == tool)


def test_a_prompt_file_is_a_candidate_json_or_a_text(tmp_path):
    text = tmp_path / "best_prompt.txt"
    text.write_text("Be careful.\n")
    assert read_prompt_file(text) == {"system_prompt": "Be careful.\n"}
    candidate = tmp_path / "best_candidate.json"
    candidate.write_text(json.dumps({"system_prompt": "S", "tool:submit": "Hand it in."}))
    env, system_prompt = prompted(ARITHMETIC, None, candidate)
    assert system_prompt == "S" and described(env, "submit") == "Hand it in."
    assert described(env, "add") == described(ARITHMETIC, "add") and described(ARITHMETIC, "submit") != "Hand it in."
    assert [t["function"]["parameters"] for t in env.tools] == [t["function"]["parameters"] for t in ARITHMETIC.tools]

    for content, message in (("{", "not valid JSON"), ('["S"]', "JSON object of texts"),
                             ('{"system": "S"}', r"unknown key\(s\) \['system'\]")):
        candidate.write_text(content)
        with pytest.raises(ValueError, match=message):
            read_prompt_file(candidate)
    with pytest.raises(ValueError, match="No such file"):
        read_prompt_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not both"):
        prompted(ARITHMETIC, "S", text)


def test_tool_descriptions_reach_the_right_env_of_a_mixture():
    mixture = load_envs("arithmetic,wordle")
    applied = apply_candidate(mixture, {"system_prompt": "S", "tool:submit": "Hand it in."})
    assert described(applied.specs["arithmetic"], "submit") == "Hand it in."
    assert applied.specs["wordle"] is mixture.specs["wordle"]
    with pytest.raises(ValueError, match=r"No env of arithmetic,wordle has tool\(s\) \['fly'\]"):
        apply_candidate(mixture, {"tool:fly": "Up."})


def test_episodes_are_named_by_the_texts_they_were_shown():
    assert prompt_tag(None, ARITHMETIC) == ""
    tags = {prompt_tag("A", ARITHMETIC), prompt_tag("B", ARITHMETIC), prompt_tag("", ARITHMETIC),
            prompt_tag(None, ARITHMETIC.with_tool_descriptions({"submit": "Hand it in."}))}
    assert len(tags) == 4 and "" not in tags


def test_an_env_offering_tools_per_episode_shows_the_evolved_descriptions(tiny_tokenizer, tiny_template):
    from trajlab.env.builtin.bfcl import SPEC as BFCL

    def first_prompt(spec):
        engine = RolloutEngine(spec, ScriptedGenerator(spec.oracle, tiny_tokenizer, tiny_template), tiny_tokenizer,
                               chat_template=tiny_template, parser=get_parser("auto", tiny_tokenizer),
                               limits=dict(max_turns=1, max_episode_tokens=80000), seed=0)
        (episode,) = asyncio.run(engine.run([Episode("bfcl-0", next(spec.iter_tasks("train", 0)))], concurrency=8,
                                            retries=0, retry_backoff_s=1.0))
        return episode

    plain = first_prompt(BFCL)
    shown = [tool["function"]["name"] for tool in plain.tools]
    assert 0 < len(shown) < len(BFCL.tools)  # bfcl offers only the entry's classes' functions
    episode = first_prompt(BFCL.with_tool_descriptions({shown[0]: "EVOLVED-DESCRIPTION-XYZ"}))
    assert [tool["function"]["name"] for tool in episode.tools] == shown
    assert "EVOLVED-DESCRIPTION-XYZ" in tiny_tokenizer.decode(episode.tokens.prompt_ids)
    assert "EVOLVED-DESCRIPTION-XYZ" not in tiny_tokenizer.decode(plain.tokens.prompt_ids)
