"""A real server on a loopback port: uvicorn in a thread, serving the tiny model (or a scripted fake)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from trajlab.chat.parsers import get_parser
from trajlab.config import ServeSettings
from trajlab.inference.hf import HFGenerator
from trajlab.models.loading import load_model
from trajlab.proxy import SessionRecorder, create_app

MODEL = "tiny"


@contextmanager
def running(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` on a free loopback port until the block ends; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@dataclass
class Served:
    url: str
    records: Path
    tokenizer: object
    template: str
    model: object = None


@pytest.fixture(scope="module")
def hf_server(tiny_model_dir, tiny_tokenizer, tiny_template, tmp_path_factory) -> Iterator[Served]:
    """The tiny model behind the real ``hf`` generator, as ``trajlab serve`` wires it."""
    records = tmp_path_factory.mktemp("sessions")
    model = load_model(tiny_model_dir)
    app = create_app(HFGenerator(model, tiny_tokenizer, max_batch_size=32), tiny_tokenizer, tiny_template,
                     get_parser("auto", tiny_tokenizer), MODEL, SessionRecorder(records), ServeSettings(),
                     tiny_tokenizer.model_max_length)
    with running(app) as url:
        yield Served(url, records, tiny_tokenizer, tiny_template, model)
