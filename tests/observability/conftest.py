"""Fixtures for the observability tests: the configured JSON log stream, a closed port."""

from __future__ import annotations

import io
import json
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from project.logging import JsonFormatter


@dataclass
class JsonLog:
    """What the project's own JSON handlers wrote during a test."""

    buffer: io.StringIO

    @property
    def text(self) -> str:
        return self.buffer.getvalue()

    def records(self) -> list[dict[str, Any]]:
        """Parse every line; a line that is not JSON fails the test."""
        return [json.loads(line) for line in self.text.splitlines() if line.strip()]

    def steps(self) -> list[dict[str, Any]]:
        """Return the step.start / step.end records, in order."""
        return [r for r in self.records() if r.get("logger") == "payments.engine.telemetry"]


@pytest.fixture
def json_log() -> Iterator[JsonLog]:
    """Point the configured JSON handlers (settings.LOGGING) at a buffer for one test."""
    handlers = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and isinstance(h.formatter, JsonFormatter)
    ]
    assert handlers, "settings.LOGGING configures no JSON handler on the root logger"
    buffer = io.StringIO()
    previous = [h.setStream(buffer) for h in handlers]
    try:
        yield JsonLog(buffer)
    finally:
        for handler, stream in zip(handlers, previous, strict=True):
            handler.setStream(stream)


@pytest.fixture
def closed_port() -> int:
    """Return a local TCP port that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
