"""Fixtures for serving tests (see harness.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import fakes`, `import harness`

from harness import ServerThread  # noqa: E402


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def make(engine: Any, **config: Any) -> ServerThread:
        s = ServerThread(engine, **config)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
