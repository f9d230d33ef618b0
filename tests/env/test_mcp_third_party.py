"""A third-party MCP server from PyPI as an env: ``mcp-server-calculator`` 0.2.1 (one tool, ``calculate``, no
network), run in the sandbox from its own install, apart from trajlab's venv (it needs ``mcp<2``; trajlab's is 2.x).

Install it with ``pip install --target DIR mcp-server-calculator==0.2.1`` and point ``TRAJLAB_MCP_CALCULATOR_DIR`` at
DIR; without it the test is skipped and says so.
"""

import os
from pathlib import Path

import pytest

from trajlab.config import McpSettings
from trajlab.env.base import EnvHandle

INSTALL = os.environ.get("TRAJLAB_MCP_CALCULATOR_DIR", "")


@pytest.mark.skipif(not (Path(INSTALL) / "mcp_server_calculator").is_dir(),
                    reason="mcp-server-calculator is not installed: pip install --target DIR "
                           "mcp-server-calculator==0.2.1 and set TRAJLAB_MCP_CALCULATOR_DIR=DIR")
def test_the_calculator_server_from_pypi_is_an_env():
    install = str(Path(INSTALL).resolve())
    spec = McpSettings(command=["/usr/bin/python3", "-m", "mcp_server_calculator"], env={"PYTHONPATH": install},
                       read_only_paths=[install]).spec()
    tools = {schema["function"]["name"]: schema["function"] for schema in spec.tools}
    assert list(tools) == ["calculate"] and "expression" in tools["calculate"]["parameters"]["properties"]
    env = EnvHandle(spec.make())
    env.reset({"prompt": "What is 6 * 7?", "answer": "42"})
    try:
        assert env.tool("calculate")(expression="6 * 7") == "42"
    finally:
        env.close()
    assert env.next_user_message("42") is None and env.reward == 1.0 and env.success
