"""The sandbox fixture: one fresh sandbox with fast limits per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sandbox.helpers import FAST
from trajlab.sandbox import Sandbox


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(FAST) as box:
        yield box
