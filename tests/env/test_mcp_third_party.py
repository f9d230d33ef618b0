"""A third-party MCP server from PyPI as an env: ``mcp-server-time`` (the MCP project's reference time server: two
tools, ``get_current_time`` and ``convert_time``, no network; installed with the ``test`` extra), run in the sandbox
from the venv's packages like the servers of ``test_mcp.py``."""

import json
import sysconfig

import pytest

from tests.env.reachable import reachable
from trajlab.config import McpSettings
from trajlab.env.base import EnvHandle
from trajlab.env.mcp_client import McpToolError

SITE = reachable(sysconfig.get_paths()["purelib"])


def test_the_time_server_from_pypi_is_an_env():
    spec = McpSettings(command=["/usr/bin/python3", "-m", "mcp_server_time", "--local-timezone", "UTC"],
                       env={"PYTHONPATH": SITE}, read_only_paths=[SITE]).spec()
    tools = {schema["function"]["name"]: schema["function"] for schema in spec.tools}
    assert sorted(tools) == ["convert_time", "get_current_time"]
    assert set(tools["convert_time"]["parameters"]["properties"]) == {"source_timezone", "time", "target_timezone"}
    env = EnvHandle(spec.make())
    env.reset({"prompt": "It is 12:00 in Tokyo. What time is it in Kolkata?", "answer": "08:30"})
    try:  # neither zone has daylight saving time: the answer holds on any day
        converted = json.loads(env.tool("convert_time")(source_timezone="Asia/Tokyo", time="12:00",
                                                        target_timezone="Asia/Kolkata"))
        with pytest.raises(McpToolError, match="Invalid timezone"):  # the engine shows it to the model as an error
            env.tool("convert_time")(source_timezone="Mars/Olympus", time="12:00", target_timezone="UTC")
    finally:
        env.close()
    assert converted["target"]["datetime"][11:16] == "08:30" and converted["time_difference"] == "-3.5h"
    assert env.next_user_message("08:30") is None and env.reward == 1.0 and env.success
