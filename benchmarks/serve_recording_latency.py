"""Latency that ``trajlab serve`` adds to generation: HTTP plus recording (JSON line + fsync) per call.

The same greedy chat prompts run in one process, the modes taking turns on slices of the requests so that load from
other jobs falls on all of them alike: (a) ``HFGenerator.generate`` called directly (no HTTP), (b) the server over
loopback HTTP with its ``SessionRecorder`` (a line appended and fsynced per call) and (c) the same server with a
recorder that writes nothing, which splits the HTTP cost from the recording cost. Each mode runs the requests one at
a time and then from several concurrent clients. The client shares the process (and the GIL) with the servers, so
the HTTP numbers include client-side cost too.

    .venv/bin/python benchmarks/serve_recording_latency.py --requests 100 --max-tokens 16 --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx2
import uvicorn

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import render, resolve_chat_template, stop_token_ids
from trajlab.config import ServeSettings
from trajlab.inference.base import GenerationRequest, SamplingParams
from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model, load_tokenizer
from trajlab.models.tiny import init_tiny_model
from trajlab.proxy import SessionRecorder, create_app

MODEL = "tiny"


class NullRecorder(SessionRecorder):
    """Records nothing: the server's cost without the JSON line and the fsync."""

    def append(self, session_id: str, record: dict[str, Any], images: Mapping[str, bytes] | None = None) -> None:
        pass


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"}]


async def timed(call: Callable[[int], Awaitable[Any]], indices: range | int, clients: int) -> list[float]:
    """Seconds per request, ``clients`` workers taking the next request index until ``indices`` are done."""
    latencies: list[float] = []
    indices = iter(range(indices) if isinstance(indices, int) else indices)

    async def worker() -> None:
        for i in indices:
            start = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(worker() for _ in range(clients)))
    return latencies


class Server:
    """uvicorn in a thread on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100, help="Requests per mode and concurrency.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8, help="Concurrent clients of the concurrent variant.")
    parser.add_argument("--record-dir", type=Path, default=None, help="Where (b) fsyncs (default: a temp dir).")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="serve_latency_"))
    model_dir = init_tiny_model(work / "tiny", seed=0)
    tokenizer = load_tokenizer(model_dir)
    template = resolve_chat_template(tokenizer)
    model = load_model(model_dir)
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0, stop_token_ids=tuple(
        stop_token_ids(tokenizer)))
    prompts = [tokenizer.encode(render(tokenizer, messages(i), [], add_generation_prompt=True,
                                       chat_template=template), add_special_tokens=False)
               for i in range(args.requests)]

    def server_app(recorder: SessionRecorder) -> Any:
        return create_app(HFGenerator(model, tokenizer, max_batch_size=32), tokenizer, template,
                          get_parser("auto", tokenizer), MODEL, recorder, ServeSettings(),
                          model.config.max_position_embeddings)

    generator = HFGenerator(model, tokenizer, max_batch_size=32)

    async def direct(client: None, i: int) -> None:
        await generator.generate(GenerationRequest(prompt_ids=prompts[i], params=params))

    async def over_http(client: httpx2.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": messages(i), "max_tokens": args.max_tokens, "temperature": 0}
        response = await client.post("/chat/completions", json=body)
        response.raise_for_status()

    async def measure(recorded_url: str, null_url: str) -> list[tuple[str, int, list[float]]]:
        """Every mode takes a slice of the requests in turn, so load from other jobs falls on all of them alike."""
        async with (httpx2.AsyncClient(base_url=recorded_url + "/sessions/bench/v1", timeout=120) as recorded,
                    httpx2.AsyncClient(base_url=null_url + "/sessions/bench/v1", timeout=120) as null):
            modes = [("(a) direct HFGenerator.generate", direct, None),
                     ("(b) serve + recording (fsync)", over_http, recorded),
                     ("(c) serve, no-op recorder", over_http, null)]
            for _, call, client in modes:  # warm-up: torch, connections, the session file
                await timed(lambda i, call=call, client=client: call(client, i), 4, 1)
            rows = []
            for clients in (1, args.clients):
                latencies: dict[str, list[float]] = {name: [] for name, _, _ in modes}
                step = max(10, 2 * clients)
                for first in range(0, args.requests, step):
                    indices = range(first, min(first + step, args.requests))
                    for name, call, client in modes:
                        latencies[name] += await timed(
                            lambda i, call=call, client=client: call(client, i), indices, clients)
                rows += [(name, clients, latencies[name]) for name, _, _ in modes]
            return rows

    record_dir = args.record_dir or work / "sessions"
    with (Server(server_app(SessionRecorder(record_dir))) as recorded_url,
          Server(server_app(NullRecorder(work / "unused"))) as null_url):
        rows = asyncio.run(measure(recorded_url, null_url))

    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    load = tuple(round(x, 2) for x in os.getloadavg())
    shared = " (load above 1: the machine was shared with other jobs)" if load[0] > 1 else ""
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"loadavg {load}{shared}")
    print(f"tiny model on CPU, greedy, max_tokens={args.max_tokens}, {args.requests} requests per row, "
          f"records in {record_dir}")
    print()
    print("| mode | clients | p50 ms | p99 ms | mean ms | p50 added vs (a) |")
    print("|---|---|---|---|---|---|")
    base = {}
    for mode, clients, latencies in rows:
        p50 = percentile(latencies, 0.5) * 1e3
        base.setdefault(clients, p50)
        print(f"| {mode} | {clients} | {p50:.1f} | {percentile(latencies, 0.99) * 1e3:.1f} | "
              f"{statistics.mean(latencies) * 1e3:.1f} | {p50 - base[clients]:+.1f} |")


if __name__ == "__main__":
    main()
