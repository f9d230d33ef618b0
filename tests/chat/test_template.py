"""Token-exact multi-turn episodes under real chat templates (tiny, Qwen2.5, Qwen3, Llama 3.1).

TRL ships the Jinja text of each family's template; each is put on an offline byte-level BPE tokenizer with the
family's special tokens. A scripted policy (a stand-in for the model, named as such) answers with exactly the text
the template renders for its turn, so the whole episode must decode to the template's render of the final messages.
"""

import asyncio

import pytest

from tests.chat.families import FAMILIES, TEMPLATES, family_tokenizer
from trajlab.chat.parsers import get_parser
from trajlab.chat.template import (
    ChatTemplate,
    TemplateNotPrefixPreservingError,
    find_prefix_violation,
    resolve_chat_template,
)
from trajlab.env import Environment, tool_call_message
from trajlab.env.registry import EnvSpec
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


class Dictionary(Environment):
    """Looks words up."""

    def reset(self, **task):
        super().reset()
        return "What are apple and pear?"

    def lookup(self, word: str) -> str:
        """Look a word up.

        Args:
            word: the word
        """
        self.metrics["lookups"] = self.metrics.get("lookups", 0) + 1
        if word == "pear":
            self.reward = 1.0
        return {"apple": "a fruit", "pear": "another fruit"}.get(word, "unknown")


def scripted_policy(task, messages):
    """Stand-in for a model: two lookups, one per turn, then a final answer."""
    calls = sum(1 for m in messages if m["role"] == "tool")
    if calls < 2:
        return tool_call_message("lookup", {"word": ["apple", "pear"][calls]})
    return {"role": "assistant", "content": "Both are fruits."}


def run_episode(tokenizer, template):
    spec = EnvSpec(name="dictionary", env_cls=Dictionary, system_prompt="You know words.")
    generator = ScriptedGenerator(scripted_policy, tokenizer, template, name="scripted")
    engine = RolloutEngine(spec, generator, tokenizer, chat_template=template, parser=get_parser("auto", tokenizer),
                           seed=0)
    return asyncio.run(engine.run_episode(Episode("e", {})))


def assistant_spans(tokenizer, template, messages, ends):
    """Independently: each assistant turn's text as the template renders it, up to its end-of-turn token."""
    chat = ChatTemplate(tokenizer, [], template)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat.render(messages[:i], add_generation_prompt=True)
        block = chat.render(messages[: i + 1])[len(before):]
        cut = max(block.rfind(end) + len(end) for end in ends if end in block)
        spans.append(block[:cut])
    return spans


def contiguous_spans(ids, mask):
    spans, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


@pytest.mark.parametrize("family", ["tiny", *FAMILIES])
def test_episode_tokens_equal_the_template_render(family, tiny_tokenizer):
    if family == "tiny":
        tokenizer, ends = tiny_tokenizer, ("<|im_end|>",)
    else:
        tokenizer, ends = family_tokenizer(family), FAMILIES[family][4]
    template = resolve_chat_template(tokenizer)  # stock Qwen3 is swapped for its training variant here
    trajectory = run_episode(tokenizer, template)
    assert trajectory.status == "success" and trajectory.metrics["turns"] == 3
    assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                        "assistant"]
    tokens = trajectory.tokens
    rendered = tokenizer.apply_chat_template(trajectory.messages, tools=trajectory.tools, tokenize=False,
                                             chat_template=template)
    assert tokenizer.decode(tokens.prompt_ids + tokens.completion_ids, skip_special_tokens=False) == rendered

    spans = contiguous_spans(tokens.completion_ids, tokens.loss_mask)
    expected = assistant_spans(tokenizer, template, trajectory.messages, ends)
    assert [tokenizer.decode(span, skip_special_tokens=False) for span in spans] == expected
    assert sum(tokens.loss_mask) == sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in expected)


def test_stock_qwen3_rewrites_history_and_is_never_used_silently(caplog):
    tokenizer = family_tokenizer("qwen3")
    violation = find_prefix_violation(tokenizer)
    assert violation is not None and "think>" in violation
    with pytest.raises(TemplateNotPrefixPreservingError, match="not prefix-preserving.*training variants"):
        resolve_chat_template(tokenizer, on_unsafe="refuse")
    swapped = resolve_chat_template(tokenizer, on_unsafe="swap")
    assert swapped == (TEMPLATES / "qwen3_training.jinja").read_text()
    assert "training variant" in caplog.text


def test_unknown_unsafe_template_trains_one_sample_per_turn_or_is_refused(caplog):
    # Stock Qwen3 with one edit: no longer recognised by TRL, so no safe variant exists.
    edited = (TEMPLATES / "qwen3.jinja").read_text() + "{#- edited -#}"
    tokenizer = family_tokenizer("qwen3", template=edited)
    assert resolve_chat_template(tokenizer, on_unsafe="swap") == edited
    assert "is not prefix-preserving" in caplog.text and "one sample per turn" in caplog.text
    assert not ChatTemplate(tokenizer, [], edited).preserves_prefixes  # so the engine keeps branches
    with pytest.raises(TemplateNotPrefixPreservingError, match="is not prefix-preserving.*on_unsafe='branch'"):
        resolve_chat_template(tokenizer, on_unsafe="refuse")
