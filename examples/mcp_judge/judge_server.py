"""A STAND-IN for a judge model: an OpenAI-compatible chat server (FastAPI, uvicorn) that grades by a plain rule
instead of an LLM, because no model able to grade runs on a CPU. Point the config's judge at a real
OpenAI-compatible server instead (vLLM, ``trajlab serve`` with a real model, a hosted API) and nothing else changes.

The rule, read from the prompt ``trajlab.rewards.judge:LLMJudge`` sends (the task as JSON, then the conversation):

- 1: the assistant's final answer contains the task's expected number (its ``answer``);
- 0.5: a tool's result showed that number, but the final answer does not;
- 0: otherwise.

    python examples/mcp_judge/judge_server.py --port-file PORT_FILE --log REQUESTS.jsonl

It listens on a free loopback port, writes the port to ``--port-file`` once it is ready, and appends one line per
request (its score) to ``--log``.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

MODEL = "rule-judge-stand-in"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def grade(prompt: str) -> tuple[float, str]:
    """The score of the conversation in an LLMJudge prompt, and why."""
    task_json = prompt.split("# Task (as the environment received it)\n", 1)[1].split("\n\n# Conversation\n", 1)[0]
    expected = float(json.loads(task_json)["answer"])
    blocks = prompt.split("\n\n# Conversation\n", 1)[1].split("\n\n[")
    final = next((b for b in reversed(blocks) if b.lstrip("[").startswith("assistant]") and "-> calls" not in b), "")
    tools = " ".join(b for b in blocks if b.startswith("tool "))
    if expected in numbers(final.split("]", 1)[-1]):
        return 1.0, "The final answer gives the expected number."
    if expected in numbers(tools):
        return 0.5, "A tool returned the expected number, but the final answer does not give it."
    return 0.0, "Neither the final answer nor a tool's result gives the expected number."


def numbers(text: str) -> set[float]:
    return {float(match) for match in NUMBER.findall(text)}


def app(log: Path | None) -> FastAPI:
    """The OpenAI-compatible routes a judge client uses: ``/v1/models`` and ``/v1/chat/completions``."""
    server = FastAPI()

    @server.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "trajlab-example"}]}

    @server.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        score, why = grade(body["messages"][-1]["content"])
        if log is not None:
            with log.open("a") as file:
                file.write(json.dumps({"model": body.get("model"), "score": score}) + "\n")
        text = f"{why}\nSCORE: {score:g}"
        return {"id": "judge", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": len(body["messages"][-1]["content"].split()),
                          "completion_tokens": len(text.split()), "total_tokens": 0}}

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port-file", type=Path, required=True, help="where to write the port once listening")
    parser.add_argument("--log", type=Path, default=None, help="a JSON-lines file of the requests' scores")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app(args.log), log_level="warning", lifespan="off"))

    def announce() -> None:  # the port, once the server accepts requests
        while not server.started:
            time.sleep(0.05)
        args.port_file.write_text(str(sock.getsockname()[1]))

    threading.Thread(target=announce, daemon=True).start()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
