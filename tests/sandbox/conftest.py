"""The sandbox fixture: one fresh sandbox with fast limits per test, in each mode this machine supports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sandbox.helpers import FAST, MODES
from trajlab.sandbox import Sandbox


@pytest.fixture(params=MODES)
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    with Sandbox(FAST, **request.param) as box:
        yield box
