"""Session files: one line per call, intact under concurrent writers, torn tails repaired, ids never paths."""

from __future__ import annotations

import json
import threading

import pytest

from trajlab.proxy.recording import SessionRecorder, read_session


def test_concurrent_appends_keep_every_line_whole_and_in_its_own_file(tmp_path):
    recorder = SessionRecorder(tmp_path)
    payload = "x" * 20000  # longer than a pipe buffer: a torn interleaving would show

    def write(session: str) -> None:
        for n in range(25):
            recorder.append(session, {"session_id": session, "n": n, "payload": payload})

    threads = [threading.Thread(target=write, args=(f"s{i % 4}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(4):
        stored = list(read_session(tmp_path / f"s{i}.jsonl"))
        assert len(stored) == 50 and {r["session_id"] for r in stored} == {f"s{i}"}


def test_a_torn_last_line_is_dropped_before_the_next_write(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"n": 0}) + "\n" + '{"n": 1, "cut sh')
    assert [r["n"] for r in read_session(path)] == [0]
    SessionRecorder(tmp_path).append("s", {"n": 2})
    assert [r["n"] for r in read_session(path)] == [0, 2]


@pytest.mark.parametrize("session", ["", "../x", "a/b", "a b", "x" * 129, "ü"])
def test_session_ids_that_are_not_plain_names_are_refused(tmp_path, session):
    with pytest.raises(ValueError, match="invalid session id"):
        SessionRecorder(tmp_path).append(session, {})
