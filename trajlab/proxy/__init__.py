"""OpenAI-compatible server that records every call of every session with its exact token ids.

``create_app`` builds the FastAPI app from already-built collaborators (generator, tokenizer, chat template, parser,
recorder) and the config's ``serve`` section (:class:`trajlab.config.ServeSettings`); ``server.build_app`` loads
them from a model directory for ``trajlab serve``.
"""

from trajlab.errors import require

require("fastapi", feature="trajlab serve (and traces export)", install="pip install 'trajlab[serve]'")

from trajlab.proxy.local import create_app  # noqa: E402 (after the check: a missing fastapi is one line)
from trajlab.proxy.recording import SessionRecorder  # noqa: E402

__all__ = ["SessionRecorder", "create_app"]
