"""The trainer's side of a full-weight sync to a vLLM server, against a loopback server that speaks vLLM's
weight-update protocol (its transfer rank a real gloo peer in this process) and fails in the middle of an update."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.inference.loopback import JSONHandler, serving
from trajlab.inference import weight_broadcast
from trajlab.inference.openai_client import ServerError
from trajlab.inference.vllm_server import VLLMServerGenerator


class _FailsTheUpdate(JSONHandler):
    """Joins the trainer's transfer group, then answers ``update_weights`` with an error without receiving."""

    calls: list[str] = []
    group = None  # its transfer rank, kept alive: a server that fails an update has not crashed

    def do_GET(self):  # noqa: N802 - http.server's name
        self.calls.append(self.path)
        self.answer(200, {"world_size": 1})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.calls.append(self.path.split("?")[0])
        if self.path == "/init_weight_transfer_engine":
            info = body["init_info"]
            type(self).group = weight_broadcast.open_group(info["master_address"], info["master_port"], 1,
                                                           info["world_size"])
        if self.path == "/update_weights":
            self.answer(500, {"error": "the model has no weight named 'nope'"})
        else:
            self.answer(200, {"success": True})


def test_a_server_failing_the_update_fails_the_sync_at_once_resumes_and_gets_a_new_group_next_time():
    model = torch.nn.Linear(64, 64)
    try:
        with serving(_FailsTheUpdate) as server:
            generator = VLLMServerGenerator(f"http://127.0.0.1:{server.server_port}/v1", "tiny", None,
                                            adapter_dir="unused")
            generator.connect_weight_transfer()
            assert generator._group is not None
            started = time.monotonic()
            with pytest.raises(ServerError, match=r"update_weights answered HTTP 500: .*no weight named 'nope'"):
                generator.load_full_weights(model)
            assert time.monotonic() - started < 30, "not after the transfer group's timeout"
    finally:
        _FailsTheUpdate.group = None  # its rank leaves: the trainer's stuck broadcast fails and its thread ends
        time.sleep(1)
    assert _FailsTheUpdate.calls[-4:] == ["/pause", "/start_weight_update", "/update_weights", "/resume"]
    assert generator._group is None and generator.weight_loads == 0, "the next sync opens a new group"
