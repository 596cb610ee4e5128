"""Fixtures of the KV event tests: a private ZeroMQ context and ipc endpoints in a
temporary directory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def ipc(tmp_path: Path) -> Callable[[str], str]:
    """``name`` -> an ipc endpoint in this test's temporary directory."""
    return lambda name: f"ipc://{tmp_path / name}"
