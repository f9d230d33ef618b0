import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from trajlab.data.store import StoreError, TrajectoryStore, read_trajectories
from trajlab.rollout.types import TokenRecord, Trajectory


def make(i: int) -> Trajectory:
    return Trajectory(id=f"ep{i}", env="toy", task={"i": i}, messages=[{"role": "user", "content": "hi"}], tools=[],
                      reward=1.0, status="success",
                      tokens=TokenRecord(prompt_ids=[1, 2], completion_ids=[3, 4], loss_mask=[1, 0],
                                         logprobs=[-0.5, None]))


def test_append_and_read_back(tmp_path):
    path = tmp_path / "t.jsonl"
    with TrajectoryStore(path) as store:
        for i in range(3):
            store.append(make(i))
    assert [t.id for t in read_trajectories(path)] == ["ep0", "ep1", "ep2"]
    with TrajectoryStore(path) as store:
        assert store.ids == {"ep0", "ep1", "ep2"}
        with pytest.raises(StoreError, match="already in"):
            store.append(make(1))


def test_torn_tail_is_dropped_and_earlier_lines_survive(tmp_path):
    path = tmp_path / "t.jsonl"
    with TrajectoryStore(path) as store:
        store.append(make(0))
    whole = path.read_bytes()
    path.write_bytes(whole + json.dumps(make(1).model_dump())[:40].encode())  # a write cut by a crash
    assert [t.id for t in read_trajectories(path)] == ["ep0"]
    with TrajectoryStore(path) as store:
        assert store.ids == {"ep0"}
        store.append(make(1))
    assert [t.id for t in read_trajectories(path)] == ["ep0", "ep1"]


def test_a_bad_complete_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    broken = make(1).model_dump()
    broken["tokens"]["loss_mask"] = [1]
    path.write_text(json.dumps(make(0).model_dump()) + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(StoreError, match=r"(?s)t\.jsonl:2: .*token invariant broken"):
        list(read_trajectories(path))


def test_one_writer_at_a_time(tmp_path):
    path = tmp_path / "t.jsonl"
    with TrajectoryStore(path), pytest.raises(StoreError, match="another process"), TrajectoryStore(path):
        pass


@pytest.mark.slow(25)
def test_kill_9_mid_collection_then_resume(tmp_path, tiny_model_dir):
    """A real SIGKILL of a collecting process loses only episodes in flight; the same command completes the file."""
    out = tmp_path / "demos.jsonl"
    total = 300
    command = [sys.executable, "-m", "trajlab.cli", "collect", "--env", "arithmetic", "--policy", "oracle",
               "--tokenizer", str(tiny_model_dir), "--episodes", str(total), "--out", str(out), "--concurrency", "4"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 20:
            break
        time.sleep(0.05)
    assert process.poll() is None, f"collector ended before it could be killed: {process.stderr.read().decode()}"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    before = list(read_trajectories(out))
    assert 20 <= len(before) < total, "the kill must land mid-collection"

    subprocess.run(command, check=True, capture_output=True, timeout=300)
    after = list(read_trajectories(out))
    assert len(after) == total
    assert len({t.id for t in after}) == total
    assert [t.id for t in after[: len(before)]] == [t.id for t in before], "earlier lines are never rewritten"
    for trajectory in after:
        tokens = trajectory.tokens
        assert len(tokens.completion_ids) == len(tokens.loss_mask) == len(tokens.logprobs)
        assert trajectory.status == "success"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a small tmpfs: needs root")
@pytest.mark.slow(21)
def test_disk_full_mid_collection_is_one_clear_error_and_the_file_stays_valid(tmp_path, tiny_model_dir):
    """collect into a 192 KiB tmpfs (in a private mount namespace): the disk fills mid-run, the command says so in
    one line, exit code 1, and the file holds only whole episodes; with room again the same command completes it."""
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    kept.mkdir()
    collect = (f"{sys.executable} -m trajlab.cli collect --env arithmetic --policy oracle --tokenizer {tiny_model_dir} "
               f"--episodes 200 --out {disk}/demos.jsonl")
    script = f"""
mount -t tmpfs -o size=192k tmpfs {disk}
{collect} > {kept}/full.log 2>&1; echo $? > {kept}/full.rc
cp {disk}/demos.jsonl {kept}/after-full.jsonl
mount -o remount,size=64m {disk}
{collect} > {kept}/resumed.log 2>&1; echo $? > {kept}/resumed.rc
cp {disk}/demos.jsonl {kept}/resumed.jsonl
"""
    subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script], check=True, timeout=600)
    log = (kept / "full.log").read_text()
    assert (kept / "full.rc").read_text().strip() == "1", log
    assert "Traceback" not in log and log.count("error:") == 1
    assert "No space left on device" in log and "run the same command again" in log
    raw = (kept / "after-full.jsonl").read_bytes()
    assert raw.endswith(b"\n"), "no torn tail"
    stored = list(read_trajectories(kept / "after-full.jsonl"))
    assert 10 <= len(stored) < 200 and len(raw) <= 192 * 1024
    assert (kept / "resumed.rc").read_text().strip() == "0", (kept / "resumed.log").read_text()
    resumed = list(read_trajectories(kept / "resumed.jsonl"))
    assert len(resumed) == len({t.id for t in resumed}) == 200
    assert [t.id for t in resumed[: len(stored)]] == [t.id for t in stored]


def test_a_file_that_is_not_trajectories_is_refused_not_repaired(tmp_path):
    """A last line without a newline is cut only when it is the torn start of a record: a text file that happens to
    end without a newline is no torn write, and opening it as a store must not truncate it."""
    path = tmp_path / "notes.txt"
    path.write_text("my notes, no newline at the end")
    for _ in range(2):  # the second time it says the same, not "being written by another process": no lock kept
        with pytest.raises(StoreError, match="notes.txt:1: not a trajectory line"):
            TrajectoryStore(path).__enter__()
    with pytest.raises(StoreError, match="not a trajectory line"):
        list(read_trajectories(path))
    assert path.read_text() == "my notes, no newline at the end"


def test_a_trajectory_the_schema_refuses_is_stored_as_an_error_row(tmp_path):
    """A backend once answered ``token_ids: "abc"``: the letters went into the tokens, the line was written, and every
    later resume refused the file. The store checks each line against its own schema before writing it."""
    path = tmp_path / "t.jsonl"
    poisoned = make(1)
    poisoned.tokens.extend(list("abc"), trained=True)  # what list("abc") from a backend's answer became
    with TrajectoryStore(path) as store:
        store.append(make(0))
        store.append(poisoned)
        store.append(make(2))
    stored = list(read_trajectories(path))
    assert [t.id for t in stored] == ["ep0", "ep1", "ep2"]
    error = stored[1]
    assert error.status == "error" and error.tokens is None and error.task == {"i": 1}
    assert "not stored as it was: tokens.completion_ids.2: Input should be a valid integer" in error.error
    with TrajectoryStore(path) as store:  # the resume that used to refuse the file: the row is run again
        assert store.ids == {"ep0", "ep1", "ep2"} and store.errors == {"ep1"}


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_a_store_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    """``--out /dev/full`` read an endless device into memory; a FIFO blocked the read forever."""
    path = {"device": "/dev/full", "fifo": tmp_path / "fifo", "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(StoreError, match=f"{path}: not a regular file"), TrajectoryStore(path):
        pass
