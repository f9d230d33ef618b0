"""Memory of `trajlab serve` under a long mixed load: does its RSS stay bounded?

    python benchmarks/serve_soak.py [--requests 3000] [--prefix-cache-mb 64]

Starts `trajlab serve` on the tiny model (a real subprocess on loopback), warms it up, then sends rounds of calls from
8 clients: multi-turn sessions that grow (each turn repeats the history, so the kept key/value states are used and
replaced), fresh prompts of random words, and hostile calls (malformed JSON, numbers beyond float range, lone
surrogates, deep nesting, oversized bodies, clients that disconnect mid-generation). The server's RSS (VmRSS of its
process) is read after the warm-up and after every round. The prefix cache is bounded (``--prefix-cache-mb``), so
after it has filled, RSS should stay flat: the report gives RSS per round and the growth over the last half.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from _serve import start_server

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "seven", "green", "birds", "sang", "about", "rivers",
         "mountains", "and", "old", "tools"]
HOSTILE = [
    b'{"model": "tiny", "messages": [',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": 1e400}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b"[" * 3000,
    b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e-320}',
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def post(url: str, body: bytes, timeout: float = 60) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def chat(base: str, session: str, messages: list[dict], max_tokens: int) -> str:
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0})
    request = urllib.request.Request(f"{base}/sessions/{session}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"].get("content") or ""


def disconnect(host: str, port: int) -> None:
    """A client that asks for a long answer and goes away."""
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 800, "temperature": 0}).encode()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /sessions/gone/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.1)


def one_call(base: str, host: str, port: int, rng: random.Random, sessions: dict[str, list[dict]]) -> str:
    """One call of a random kind; returns the kind (with the status for a hostile call)."""
    kind = rng.choices(["session", "fresh", "hostile", "disconnect"], weights=[55, 30, 12, 3])[0]
    if kind == "session":
        name = f"s{rng.randrange(40)}"
        history = sessions.setdefault(name, [])
        if len(history) > 12:
            history.clear()
        history.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))})
        history.append({"role": "assistant", "content": chat(base, name, history, 24)})
    elif kind == "fresh":
        chat(base, f"f{rng.randrange(10**9)}", [{"role": "user", "content": " ".join(rng.choices(WORDS, k=40))}],
             16)
    elif kind == "hostile":
        return f"hostile {post(f'{base}/v1/chat/completions', rng.choice(HOSTILE))}"
    else:
        disconnect(host, port)
    return kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prefix-cache-mb", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="trajlab-serve-soak-"))
    server, port = start_server(work, ["--prefix-cache-mb", str(args.prefix_cache_mb), "--body-timeout", "5"])
    base = f"http://127.0.0.1:{port}"
    try:
        rng = random.Random(0)
        sessions: dict[str, list[dict]] = {}
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(lambda _: one_call(base, "127.0.0.1", port, random.Random(rng.random()), sessions),
                          range(200)))
            readings = [("after 200 warm-up calls", rss_mb(server.pid))]
            per_round = args.requests // args.rounds
            started = time.time()
            kinds: dict[str, int] = {}
            for round_index in range(args.rounds):
                seeds = [rng.random() for _ in range(per_round)]
                for kind in pool.map(lambda s: one_call(base, "127.0.0.1", port, random.Random(s), sessions), seeds):
                    kinds[kind] = kinds.get(kind, 0) + 1
                readings.append((f"after round {round_index + 1} ({(round_index + 1) * per_round} calls)",
                                 rss_mb(server.pid)))
        elapsed = time.time() - started
        if server.poll() is not None:
            raise SystemExit(f"the server died: {server.stderr.read().decode()}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"trajlab serve, tiny model, prefix cache {args.prefix_cache_mb} MiB, {args.clients} clients, "
          f"{sum(kinds.values())} calls in {elapsed:.0f} s: {kinds}")
    for label, value in readings:
        print(f"  RSS {label:>32}: {value:7.1f} MB")
    half = readings[len(readings) // 2][1]
    print(f"growth over the second half: {readings[-1][1] - half:+.1f} MB ({readings[-1][1] / half - 1:+.1%})")


if __name__ == "__main__":
    main()
