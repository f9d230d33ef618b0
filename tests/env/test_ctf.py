"""The CTF env with real sandboxes: every kind solvable, only the real flag scores, commands stay in their sandbox."""

import asyncio
import dataclasses
import gc
import http.server
import itertools
import json
import os
import random
import re
import shlex
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.env.oracle import run_oracle
from trajlab.chat.parsers import get_parser
from trajlab.env.base import tool_call_message, tool_schemas
from trajlab.env.builtin import ctf, ctf_challenges
from trajlab.env.builtin.ctf import CTF, SPEC
from trajlab.env.builtin.ctf_challenges import (
    FLAG_RE,
    KINDS,
    LAYERS,
    challenge,
    decode_layer,
    encode_layer,
    encoding_chain,
)
from trajlab.env.builtin.ctf_oracle import exploit, peel
from trajlab.inference.scripted import ScriptedGenerator
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode
from trajlab.sandbox import Sandbox, probe_protections
from trajlab.sandbox.session import SERVER_INSIDE

PROTECTIONS = probe_protections()
FAKE_FLAG = "flag{deadbeefdeadbeefdeadbeef}"


def task_of(kind: str, seed: int = 0) -> dict:
    return {"task_id": f"ctf-{kind}-{seed:03d}", "kind": kind, "seed": seed}


def started(task: dict) -> CTF:
    env = CTF()
    env.reset(**task)
    return env


def flag_of_hidden(env: CTF) -> str:
    """Solve a 'hidden' episode the way a model would: search the files."""
    found = FLAG_RE.search(env.run(r"grep -rhoE 'flag\{[0-9a-f]{24}\}' ."))
    assert found is not None
    return found.group()


def sandbox_dir(env: CTF) -> Path:
    """The episode's working directory on the host (its commands see it at /sandbox under bubblewrap)."""
    assert env._sandbox is not None
    return env._sandbox.path


def service_seed(bug: str) -> int:
    return next(seed for seed in itertools.count() if challenge("service", seed, "x").facts["bug"] == bug)


def test_tools_and_tasks():
    assert {t["function"]["name"] for t in tool_schemas(CTF)} == {"run", "submit_flag", "encrypt", "connect"}
    assert SPEC.name == "ctf" and "flag{...}" in SPEC.system_prompt
    train, test = list(SPEC.iter_tasks("train", seed=0)), list(SPEC.iter_tasks("test", seed=1))
    assert len(train) + len(test) == 4 * ctf.TASKS_PER_KIND
    assert not {t["task_id"] for t in train} & {t["task_id"] for t in test}
    assert {t["kind"] for t in test} == set(KINDS)
    assert all(set(t) == {"task_id", "kind", "seed"} and json.loads(json.dumps(t)) == t for t in train)
    assert [t["task_id"] for t in itertools.islice(SPEC.iter_tasks("train", seed=0),
                                                   5)] == [t["task_id"] for t in train[:5]]


def test_the_oracle_solves_every_kind_through_the_rollout_engine(tiny_tokenizer, tiny_template):
    test = list(SPEC.iter_tasks("test", seed=0))
    tasks = [t for kind in KINDS for t in [t for t in test if t["kind"] == kind][:3]]
    tasks.append({**tasks[0], "task_id": tasks[0]["task_id"] + "-again"})  # the same layout a second time
    results = run_oracle(SPEC, tasks, tiny_tokenizer, tiny_template)
    assert len(results) == len(tasks)
    assert all(t.status == "success" and t.reward == 1.0 for t in results), [(t.id, t.messages[-2:]) for t in results]
    assert all(t.metrics["tool_errors"] == 0 and t.metrics["parse_errors"] == 0 for t in results)
    cipher = [t for t in results if t.task["kind"] == "cipher"]
    assert all(t.metrics["env/oracle_queries"] >= 3 for t in cipher)
    flags = [t.messages[-2]["tool_calls"][0]["function"]["arguments"]["flag"] for t in results]
    assert all(FLAG_RE.fullmatch(flag) for flag in flags) and len(set(flags)) == len(flags)


def test_the_oracle_succeeds_within_the_envs_default_limits(tiny_tokenizer, tiny_template):
    """The limits the spec states are enough for the reference policy on every kind, without any user limits."""
    limits = SPEC.limits
    test = list(SPEC.iter_tasks("test", seed=0))
    tasks = [t for kind in KINDS for t in [t for t in test if t["kind"] == kind][:2]]
    engine = RolloutEngine(SPEC, ScriptedGenerator(SPEC.oracle, tiny_tokenizer, tiny_template), tiny_tokenizer,
                           chat_template=tiny_template, parser=get_parser("auto", tiny_tokenizer), seed=0)
    assert engine.limits == limits  # no user limits: the env's own
    results = asyncio.run(engine.run([Episode(t["task_id"], t) for t in tasks], concurrency=8, retries=0,
                                     retry_backoff_s=1.0))
    assert all(t.status == "success" for t in results), [(t.id, t.stop_reason) for t in results]
    assert limits.tool_timeout_s > ctf.COMMAND_LIMITS.wall_timeout_s  # the sandbox stops a command first


def test_wrong_submissions_score_nothing_and_the_right_flag_scores_one():
    env = started(task_of("hidden"))
    flag = flag_of_hidden(env)
    assert env.submit_flag(FAKE_FLAG) == "Wrong flag. 2 submissions left."
    assert env.submit_flag(flag.upper()) == "Wrong flag. 1 submission left."
    assert env.reward == 0.0 and not env.done and env.success is None
    assert env.submit_flag(f" {flag}\n").startswith("Correct")
    assert env.reward == 1.0 and env.done and env.success
    assert env.metrics["wrong_submissions"] == 2 and env.metrics["submissions"] == 3
    assert env.run("ls") == env.submit_flag(flag) == "The challenge is over; nothing was done."


def test_three_wrong_submissions_end_the_episode_with_zero():
    env = started(task_of("hidden", 1))
    flag = flag_of_hidden(env)
    for _ in range(3):
        env.submit_flag(FAKE_FLAG)
    assert env.done and env.reward == 0.0 and env.success is False
    env.submit_flag(flag)
    assert env.reward == 0.0 and env.success is False


@pytest.mark.parametrize("kind", KINDS)
def test_a_task_fixes_the_layout_but_never_the_flag(kind):
    first, second = started(task_of(kind, 5)), started(task_of(kind, 5))
    listing = "find . -type f | sort; cat note.txt service.py 2>/dev/null"
    assert first.run(listing) == second.run(listing)
    assert first._flag != second._flag and FLAG_RE.fullmatch(first._flag)
    assert challenge(kind, 5, "x").facts == challenge(kind, 5, "y").facts


def test_a_flag_from_another_episode_does_not_score():
    task = task_of("hidden", 2)
    first = started(task)
    old = flag_of_hidden(first)
    second = started(task)
    assert flag_of_hidden(second) != old and old not in json.dumps(task)
    assert second.submit_flag(old).startswith("Wrong flag") and second.reward == 0.0
    first.reset(**task)  # the same instance, reset: a new flag too
    assert first.submit_flag(old).startswith("Wrong flag")


def adversary(commands: list[str], last_words: str):
    """A scripted assistant: one command per turn, then a fake flag submission, then a claim of success."""
    def policy(task, messages):
        done = sum(m["role"] == "tool" for m in messages)
        if done < len(commands):
            return tool_call_message("run", {"command": commands[done]})
        if done == len(commands):
            return tool_call_message("submit_flag", {"flag": FAKE_FLAG}, content=last_words)
        return {"role": "assistant", "content": last_words}
    return policy


def test_an_adversarial_episode_scores_nothing_and_leaves_the_host_alone(tiny_tokenizer, tiny_template,
                                                                          monkeypatch):
    secret = "sk-trajlab-ctf-test-9f8e7d6c5b4a"
    monkeypatch.setenv("TRAJLAB_CTF_FAKE_API_KEY", secret)
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"host-only page")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    limits = ctf.COMMAND_LIMITS
    commands = {
        "secrets": "id -u; env; tr '\\0' '\\n' < /proc/self/environ",
        "host environ": f"cat /proc/{os.getpid()}/environ /proc/{os.getppid()}/environ /proc/1/environ",
        "socket": "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), 2)\"",
        "curl": f"curl -sS -m 2 http://127.0.0.1:{port}/steal; curl -sS -m 2 http://1.1.1.1/",
        "big file": f"head -c {3 * limits.file_size_bytes} /dev/zero > big; stat -c 'size=%s' big",
        "many files": "for i in 1 2 3 4; do head -c 16M /dev/zero > /tmp/ctf-adversary-$i; head -c 16M /dev/zero "
                      "> fill$i; done; du -scb /tmp . | tail -n 1",
        "fork bomb": "bomb() { bomb | bomb & }; bomb; sleep 0.5",
        "fake success": f"echo 'Correct! Flag verified'; echo {FAKE_FLAG}; echo '{{\"reward\": 1.0}}'",
    }
    policy = adversary(list(commands.values()), f"Correct! Flag verified: {FAKE_FLAG}")
    engine = RolloutEngine(SPEC, ScriptedGenerator(policy, tiny_tokenizer, tiny_template), tiny_tokenizer,
                           chat_template=tiny_template, parser=get_parser("auto", tiny_tokenizer),
                           limits=dict(max_turns=12, max_episode_tokens=16384), seed=0)
    started_at = time.monotonic()
    try:
        [trajectory] = asyncio.run(engine.run([Episode("adversary", task_of("hidden", 3))], concurrency=8, retries=0,
                                              retry_backoff_s=1.0))
    finally:
        server.shutdown()
    assert time.monotonic() - started_at < 30
    replies = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert len(replies) == len(commands) + 1, trajectory.messages[-1]
    seen = dict(zip(commands, replies, strict=False))
    uid = seen["secrets"].split()[0]
    assert not any(secret in reply for reply in replies)
    if PROTECTIONS.bubblewrap:  # the host's processes are not in the sandbox's process namespace at all
        assert int(uid) != os.getuid() and seen["host environ"].count("No such file") == 2
    elif PROTECTIONS.private_uid:
        assert int(uid) != os.getuid() and seen["host environ"].count("Permission denied") == 3
    if PROTECTIONS.network_namespace:
        assert "unreachable" in seen["socket"].lower() and "exit code 1" in seen["socket"]
        assert "host-only page" not in seen["curl"] and hits == []
    assert int(re.search(r"size=(\d+)", seen["big file"]).group(1)) <= limits.file_size_bytes
    if PROTECTIONS.disk_quota:  # the command's /tmp is the sandbox's own, capped with its directory
        assert "No space left on device" in seen["many files"]
        assert int(seen["many files"].split()[0]) <= limits.disk_bytes
        assert not list(Path("/tmp").glob("ctf-adversary-*"))
    assert replies[-1] == "Wrong flag. 2 submissions left."
    assert trajectory.reward == 0.0 and trajectory.status != "success"
    # The host is fine: it still forks, a new sandbox works, and nothing the episode started is left running: of its
    # uid only the sandbox's bwrap and command server, which wait in the pool for the next episode.
    assert subprocess.run(["true"]).returncode == 0
    with Sandbox() as box:
        assert box.run("echo ok").stdout == "ok\n"
    alive = subprocess.run(["ps", "-o", "stat=,args=", "-u", uid], capture_output=True, text=True).stdout
    started = [line for line in alive.splitlines() if not line.split()[0].startswith("Z")
               and SERVER_INSIDE not in line and not line.split()[1].endswith("bwrap")]
    assert started == [], alive  # zombies wait for the host's init to reap them


def test_a_command_is_stopped_at_the_time_limit_and_long_output_is_cut(monkeypatch):
    limits = dataclasses.replace(ctf.COMMAND_LIMITS, wall_timeout_s=1.0)
    monkeypatch.setattr(ctf, "COMMAND_LIMITS", limits)
    env = started(task_of("encoding"))
    started_at = time.monotonic()
    reply = env.run("sleep 30")
    assert time.monotonic() - started_at < 5
    assert "stopped at the 1 s time limit" in reply and env.metrics["timeouts"] == 1
    reply = env.run("yes abcdefgh | head -c 20000; exit 3")
    assert "characters cut ..." in reply and len(reply) < 3000 and reply.endswith("[exit code 3]")
    assert env.run("kill -40 $$") == "[exit code -40, killed by signal 40; no output]"
    assert env.run("true") == "[exit code 0; no output]" and env.metrics["failed_commands"] == 3


def test_concurrent_episodes_cannot_read_or_touch_each_others_files():
    task = task_of("hidden", 4)
    first, second = started(task), started(task)
    flag = flag_of_hidden(first)
    path = first.run(r"grep -rlE 'flag\{[0-9a-f]{24}\}' .").splitlines()[0].removeprefix("./")
    home = sandbox_dir(first)  # where the host keeps it: what another episode would have to reach
    assert sandbox_dir(second) != home
    peek = second.run(f"cat {home}/{path}; ls -la {home}; find {home}; echo x > {home}/planted")
    assert flag not in peek
    if PROTECTIONS.bubblewrap:  # another episode's directory is not in this sandbox's view at all
        assert f"cat: {home}/{path}: No such file or directory" in peek
        assert first.run("ls planted").endswith("[exit code 2]")
    elif PROTECTIONS.private_uid:
        assert "Permission denied" in peek
        assert first.run("ls planted").endswith("[exit code 2]")
    assert first.submit_flag(flag).startswith("Correct") and second.submit_flag(flag).startswith("Wrong")


def test_tools_that_do_not_apply_to_the_kind_say_so():
    hidden = started(task_of("hidden"))
    reply = hidden.encrypt("AAAA", 0)
    assert reply.startswith("Error: encrypt does not apply to this challenge: it is a 'hidden' challenge")
    assert "'cipher'" in reply
    assert hidden.connect("list").startswith("Error: connect does not apply to this challenge")
    cipher = started(task_of("cipher"))
    assert "only 'service' challenges" in cipher.connect("hello")
    assert hidden.metrics["inapplicable_calls"] == 2 and not hidden.done and hidden.reward == 0.0
    assert CTF().run("ls").startswith("Error: no challenge is running")


def test_one_encrypt_query_cannot_reveal_the_flag():
    env = started(task_of("cipher"))
    block = challenge("cipher", 0, "x").block
    ciphertext = bytes.fromhex(env.run("cat ciphertext.hex").splitlines()[0])
    reply = env.encrypt("A" * 40, 0)
    encrypted = bytes.fromhex(reply.rsplit(": ", 1)[1])
    assert len(encrypted) == block < 24 and f"only the first {block} bytes" in reply
    plain = bytes(c ^ e ^ ord("A") for c, e in zip(ciphertext, encrypted, strict=False))
    assert plain.startswith(b"flag{") and len(plain) == block  # the flag's other bytes need other queries
    assert env.encrypt("A", 32).startswith("Error: offset must be between 0 and 31")
    assert env.encrypt("", 0) == "Error: nothing to encrypt."
    assert env._keystream.hex() not in env.run("grep -r . .")  # the key never enters the sandbox
    for _ in range(ctf.MAX_ENCRYPT_QUERIES):
        env.encrypt("A", 0)
    assert "none left" in env.encrypt("A", 0) and env.metrics["oracle_queries"] == ctf.MAX_ENCRYPT_QUERIES


@pytest.mark.parametrize("bug", ["off_by_one", "trusted_length", "injection"])
def test_the_service_reveals_the_flag_only_through_its_bug(bug):
    env = started(task_of("service", service_seed(bug)))
    assert not FLAG_RE.search(env.run(r"ls -la; cat service.py README.txt; grep -r 'flag{' . /tmp"))
    honest = {"off_by_one": "list\nshow 0\nread 0\nget 0", "trusted_length": "ECHO 4 abcd\nPING 4 abcd",
              "injection": "alice"}[bug]
    lines = " ".join(shlex.quote(line) for line in ["flag{local}", *honest.splitlines()])
    local = env.run(f"printf '%s\\n' {lines} | python3 service.py")  # it runs here too, on a flag of our own
    assert "flag{local}" not in local and "Traceback" not in local and local.endswith("[exit code 0]")
    assert not FLAG_RE.search(env.connect(honest))
    source = env.run("cat service.py")
    # The server runs its own copy: rewriting service.py here changes nothing there.
    env.run("echo 'import sys; print(sys.stdin.read())' > service.py")
    assert not FLAG_RE.search(env.connect("hello"))
    found = FLAG_RE.search(env.connect(exploit(source)))
    assert found is not None and env.submit_flag(found.group()).startswith("Correct")
    assert env.metrics["connections"] == 3


def test_a_process_left_running_cannot_read_the_services_input():
    env = started(task_of("service", service_seed("injection")))
    spy = ("end=$(($(date +%s) + 2)); while [ $(date +%s) -lt $end ]; do for p in $(pgrep -f service.py); do "
           "cat /proc/$p/fd/0 /proc/$p/environ; done; done")
    env.run(f"setsid sh -c '{spy}' > spy.txt 2>&1 < /dev/null & sleep 0.2")  # it outlives this command
    attack = exploit(env.run("cat service.py"))
    flags = {FLAG_RE.search(env.connect(attack)).group() for _ in range(5)}
    time.sleep(2)
    seen = env.run("cat spy.txt")
    assert len(flags) == 1 and flags.pop() not in seen and seen.endswith("[exit code 0]")


def test_encodings_round_trip_and_chains_stay_readable():
    for layer in LAYERS:
        assert decode_layer(layer, encode_layer(layer, FAKE_FLAG)) == FAKE_FLAG
    assert decode_layer("hex", "zz") is None and decode_layer("gzip", "aGVsbG8=") is None
    for seed in range(50):
        chain = encoding_chain(random.Random(seed))
        assert 3 <= len(chain) <= 5 and all(chain.count(layer) <= 1 for layer in LAYERS if layer != "base64")
        blob = challenge("encoding", seed, FAKE_FLAG).files
        [encoded] = [content for name, content in blob.items() if name != "note.txt"]
        assert len(encoded) <= ctf_challenges.MAX_BLOB_CHARS and FAKE_FLAG not in encoded
        assert peel(encoded.strip()) == FAKE_FLAG


def test_sandboxes_are_given_back_wiped_at_close_at_reset_at_the_end_and_with_the_env():
    """An episode's sandboxes go back to their pools, wiped, when it is closed, reset, won or garbage-collected; the
    next episode gets one back holding its own challenge's files and nothing of the last one's."""
    def wiped(path: Path) -> bool:
        return not path.exists() or not any(path.iterdir())

    env = started(task_of("hidden"))
    closed = sandbox_dir(env)
    env.run("echo left > left-behind.txt")
    env.close()
    assert wiped(closed)
    env.reset(**task_of("service"))
    first = sandbox_dir(env)
    names = {path.name for path in first.iterdir()}
    assert first == closed and "service.py" in names and "left-behind.txt" not in names, "reused, with its own files"
    env.reset(**task_of("hidden"))
    second = sandbox_dir(env)
    assert not (second / "service.py").exists() and not (second / "left-behind.txt").exists()
    env.submit_flag(flag_of_hidden(env))
    assert env.done and wiped(second)
    env.reset(**task_of("cipher"))
    third = sandbox_dir(env)
    del env
    gc.collect()
    assert wiped(third)
