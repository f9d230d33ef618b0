"""32 sessions at once, two calls each, through AsyncOpenAI: nothing lost, nothing mixed between sessions."""

from __future__ import annotations

import asyncio
import hashlib

from openai import AsyncOpenAI

from trajlab.proxy.recording import read_session

from .conftest import MODEL

SESSIONS = 32


async def converse(url: str, i: int) -> tuple[str, list[str], list[dict]]:
    """Session i names itself by path, header or API key in turn; returns (file stem, response ids, messages)."""
    key = f"sk-load-{i}"
    if i % 3 == 0:
        session, api = f"load-{i}", AsyncOpenAI(base_url=f"{url}/sessions/load-{i}/v1", api_key=key, max_retries=0)
    elif i % 3 == 1:
        session = f"load-{i}"
        api = AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                          default_headers={"X-Trajlab-Session": session})
    else:
        session = "key-" + hashlib.sha256(key.encode()).hexdigest()[:32]
        api = AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": f"I am session {i}."}]
    ids = []
    async with api:
        for turn in range(2):
            response = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                         temperature=1.0, extra_body={"return_token_ids": True})
            ids.append(response.id)
            messages = [*messages, {"role": "assistant", "content": response.choices[0].message.content or ""},
                        {"role": "user", "content": f"Session {i}, turn {turn + 1}."}]
    return session, ids, messages


def test_concurrent_sessions_lose_nothing_and_mix_nothing(hf_server):
    async def main():
        return await asyncio.gather(*(converse(hf_server.url, i) for i in range(SESSIONS)))

    results = asyncio.run(main())
    assert len({session for session, _, _ in results}) == SESSIONS
    for i, (session, ids, _) in enumerate(results):
        stored = list(read_session(hf_server.records / f"{session}.jsonl"))
        assert [r["request_id"] for r in stored] == ids, session  # exactly its own two calls, in order
        assert {r["session_id"] for r in stored} == {session}
        texts = [r["prompts"][0]["text"] for r in stored]
        assert all(f"I am session {i}." in text for text in texts)
        assert f"Session {i}, turn 1." in texts[1]
        # The second prompt holds the first answer as sent back; its tokens extend the first prompt's.
        first, second = stored
        assert second["prompts"][0]["token_ids"][:len(first["prompts"][0]["token_ids"])] == (
            first["prompts"][0]["token_ids"])
