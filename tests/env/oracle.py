"""Run an env's reference policy through the real rollout engine, as the env tests need."""

import asyncio

from trajlab.chat.parsers import get_parser
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode


def run_oracle(spec, tasks, tokenizer, template, concurrency=8, processor=None):
    engine = RolloutEngine(spec, ScriptedGenerator(spec.oracle, tokenizer, template), tokenizer,
                           chat_template=template, parser=get_parser("auto", tokenizer), processor=processor, seed=0)
    return asyncio.run(engine.run([Episode(t["task_id"], t) for t in tasks], concurrency=concurrency, retries=0,
                                  retry_backoff_s=1.0))
