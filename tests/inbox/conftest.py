"""Fixtures for the inbox tests: real PostgreSQL, real Redis.

`inbox_queue`, `effects` and `seen` live in tests/conftest.py (tests/crash/ uses them too).
"""

from __future__ import annotations

import pytest

from inbox.queues import MessageQueue


@pytest.fixture
def queue(inbox_queue: MessageQueue) -> MessageQueue:
    """In this folder `queue` is the inbox test queue, not the payments queue."""
    return inbox_queue
