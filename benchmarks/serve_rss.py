"""Memory of `trajlab serve` under a hostile mix: does its RSS stay near its warm-up level, and come back after?

    python benchmarks/serve_rss.py [--requests 400] [--warmup 100] [--clients 4] [--kinds huge_body,n16]

Starts `trajlab serve` on the tiny model (a real subprocess on loopback, its default settings but for the port and
the record folder, plus any `--serve-arg`), warms it up with normal multi-turn chat calls, reads its RSS (VmRSS),
then sends the hostile mix from a few clients: bodies just under and over the size limit (declared and chunked),
tens of thousands of messages, thousands of tools, prompts that fill the context, the largest max_tokens the context
allows, n=16, completions of many prompts, huge images, malformed JSON and HTTP, streaming, slow and vanishing
clients. RSS is sampled every 50 ms throughout; the table gives warm-up, peak and after (once the last call is
answered and the server has been idle a moment), and their ratios to the warm-up level.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import io
import json
import random
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from _serve import start_server

MODEL = "tiny"
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "seven", "green", "birds", "sang", "about", "rivers"]
CHAT = "/v1/chat/completions"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Client:
    """Raw HTTP/1.1 over a fresh socket per call, so a call may also send garbage, stall or vanish."""

    def __init__(self, port: int) -> None:
        self.port = port

    def send(self, raw: bytes, *, read_timeout: float = 120.0, close_after: float | None = None) -> str:
        """The response's status (or what became of the call): ``raw`` is sent as it is."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=read_timeout) as sock:
            with contextlib.suppress(OSError):  # the server answered (413) and closed before the whole body was sent
                sock.sendall(raw)
            if close_after is not None:
                time.sleep(close_after)
                return "left"
            try:
                head = sock.recv(65536)
                while head and len(head) < 12:
                    head += sock.recv(65536)
                while sock.recv(1 << 20):  # drain the body (the server closes: Connection: close)
                    pass
            except TimeoutError:
                return "timed out"
            except OSError:
                pass
        return head[9:12].decode() if head.startswith(b"HTTP/") else "no answer"

    def post(self, path: str, body: bytes | dict, **options) -> str:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        return self.send(head + data, **options)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chunked(path: str, data: bytes, piece: int = 1 << 16) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(data[i:i + piece]), data[i:i + piece]) for i in range(0, len(data), piece)]
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode() + b"".join(parts) + b"0\r\n\r\n"


def big_png(side: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def hostile_kinds(limit: int) -> dict[str, Callable[[Client, random.Random], str]]:
    """Each kind of hostile call by name; ``limit`` is the server's body limit in bytes."""
    image = big_png(5000)
    under = limit - 4096
    return {
        "huge_body": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": user("ab " * (under // 3))}),
        "oversized": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": user("ab " * (limit // 2))}),
        "oversized_chunked": lambda c, r: c.send(chunked(CHAT, json.dumps(
            {"model": MODEL, "messages": user("ab " * (limit // 2))}).encode())),
        "many_messages": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(under // 40)]}),
        "many_tools": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": user("hi"), "tools": [
            {"type": "function", "function": {"name": f"t{i}", "description": "d" * 40}}
            for i in range(under // 130)]}),
        "full_context": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": user(words(r, 14000)),
                                                   "max_tokens": 8}),
        "max_tokens": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": user(words(r, 5)),
                                                 "max_tokens": 32000}, read_timeout=3.0),
        "n16": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": user(words(r, 30)), "n": 16,
                                          "max_tokens": 64, "logprobs": True}),
        "many_prompts": lambda c, r: c.post("/v1/completions", {"model": MODEL, "prompt": [
            words(r, 20) for _ in range(16)], "n": 16, "max_tokens": 8}),
        "image": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}]}]}),
        "stream": lambda c, r: c.post(CHAT, {"model": MODEL, "messages": user(words(r, 20)), "stream": True,
                                             "max_tokens": 64, "stream_options": {"include_usage": True}}),
        "vanish": lambda c, r: c.post("/v1/completions", {"model": MODEL, "prompt": words(r, 20),
                                                          "max_tokens": 2000}, close_after=0.3),
        "slow_body": lambda c, r: c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000"
                                         b"\r\n\r\n{\"model\": ", close_after=0.3),
        "bad_json": lambda c, r: c.post(CHAT, b'{"model": "tiny", "messages": [' + b"1," * 100000),
        "deep_json": lambda c, r: c.post(CHAT, b"[" * 200000),
        "bad_http": lambda c, r: c.send(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"),
        "new_session": lambda c, r: c.post(f"/sessions/s{r.randrange(10**12)}{CHAT}",
                                           {"model": MODEL, "messages": user(words(r, 10)), "max_tokens": 16}),
    }


def warm_call(client: Client, rng: random.Random, index: int) -> str:
    """A normal call: one of 20 sessions, a few turns long."""
    session, turns = f"warm{index % 20}", 1 + (index // 20) % 4
    messages = []
    for _ in range(turns):
        messages += [{"role": "user", "content": words(rng, 12)}, {"role": "assistant", "content": words(rng, 8)}]
    messages.append({"role": "user", "content": words(rng, 12)})
    return client.post(f"/sessions/{session}{CHAT}", {"model": MODEL, "messages": messages, "max_tokens": 32})


class Sampler(threading.Thread):
    """Reads the server's RSS every 50 ms; ``peak`` is the largest seen since the last ``reset``, and ``at_peak``
    the calls in flight when it was seen (``calling`` counts them), which says what the peak is made of."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()
        self.in_flight: Counter[str] = Counter()
        self.at_peak: Counter[str] = Counter()
        self.lock = threading.Lock()

    def reset(self) -> None:
        self.peak = rss_mb(self.pid)

    @contextlib.contextmanager
    def calling(self, kind: str):
        with self.lock:
            self.in_flight[kind] += 1
        try:
            yield
        finally:
            with self.lock:
                self.in_flight[kind] -= 1

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                now = rss_mb(self.pid)
            except (OSError, RuntimeError):
                return
            if now > self.peak:
                with self.lock:
                    self.peak, self.at_peak = now, +self.in_flight


def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="trajlab-serve-rss-"))
    server, port = start_server(work, args.serve_arg)
    client, rng = Client(port), random.Random(0)
    kinds = hostile_kinds(args.max_body_bytes)
    chosen = args.kinds.split(",") if args.kinds else sorted(kinds)
    unknown = sorted(set(chosen) - set(kinds))
    if unknown:
        server.kill()
        raise SystemExit(f"unknown kinds {unknown}; the kinds are {sorted(kinds)}")
    sampler = Sampler(server.pid)
    sampler.start()
    outcomes: Counter[str] = Counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            seeds = [rng.random() for _ in range(args.warmup)]
            warm = Counter(pool.map(lambda i: warm_call(client, random.Random(seeds[i]), i), range(args.warmup)))
            time.sleep(1.0)
            warm_rss = rss_mb(server.pid)
            sampler.reset()
            plan = [(chosen[i % len(chosen)], rng.random()) for i in range(args.requests)]
            rng.shuffle(plan)
            started = time.time()

            def hostile(kind: str, seed: float) -> tuple[str, str]:
                with sampler.calling(kind):
                    return kind, kinds[kind](client, random.Random(seed))

            for kind, status in pool.map(lambda p: hostile(*p), plan):
                outcomes[f"{kind} {status}"] += 1
            elapsed = time.time() - started
        time.sleep(args.settle)
        peak, after = sampler.peak, rss_mb(server.pid)
        if server.poll() is not None:
            raise SystemExit(f"the server died: {server.stderr.read().decode()}")
    finally:
        sampler.stop.set()
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    report(args, warm, warm_rss, (peak, sampler.at_peak), after, outcomes, elapsed)


def report(args: argparse.Namespace, warm: Counter, warm_rss: float, peak_seen: tuple[float, Counter], after: float,
           outcomes: Counter, elapsed: float) -> None:
    peak, at_peak = peak_seen
    print(f"trajlab serve, tiny model {' '.join(args.serve_arg)}, {args.clients} clients: {args.warmup} warm-up "
          f"calls {dict(warm)}, then {args.requests} hostile calls in {elapsed:.0f} s")
    print("| hostile call | answers |\n|---|---|")
    by_kind: dict[str, list[str]] = {}
    for outcome, count in sorted(outcomes.items()):
        kind, status = outcome.split(" ", 1)
        by_kind.setdefault(kind, []).append(f"{status} x{count}")
    for kind, statuses in by_kind.items():
        print(f"| {kind} | {', '.join(statuses)} |")
    print("\n| RSS | MB | / warm-up |\n|---|---|---|")
    for label, value in (("after warm-up", warm_rss), ("peak, hostile mix", peak), ("after", after)):
        print(f"| {label} | {value:.0f} | {value / warm_rss:.2f}x |")
    print(f"\nIn flight at the peak: {', '.join(f'{k} x{n}' for k, n in sorted(at_peak.items())) or 'nothing'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kinds", default="", help="comma-separated hostile kinds (default: all)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="the server's limit (its default)")
    parser.add_argument("--settle", type=float, default=3.0, help="idle seconds before the 'after' reading")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `trajlab serve` argument")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
