"""Shared fixtures: real PostgreSQL (pytest-django's test database), real Redis, a real
HTTP fake provider. Redis tests use their own database, flushed around each test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import django_rq
import pytest
from django.conf import settings
from redis import Redis
from rq import SimpleWorker
from rq.queue import Queue

from devtools.fake_provider.server import FakeProviderServer

TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")

# Point every queue at the test Redis database before anything creates a queue.
for _config in settings.RQ_QUEUES.values():
    _config["URL"] = TEST_REDIS_URL

#: Timeouts small enough for tests and still a valid chain (1.5 < 3 <= 3).
TEST_PAYMENTS = {
    "PROVIDER_CONNECT_TIMEOUT": 0.5,
    "PROVIDER_READ_TIMEOUT": 1.0,
    "JOB_TIMEOUT": 3,
    "CLAIM_LEASE": 3,
    "RETRY_BACKOFF": [0, 0],
}


@pytest.fixture
def redis_conn() -> Iterator[Redis]:
    conn = Redis.from_url(TEST_REDIS_URL)
    conn.flushdb()
    yield conn
    conn.flushdb()


@pytest.fixture
def queue(redis_conn: Redis) -> Queue:
    return django_rq.get_queue("payments")


@pytest.fixture
def provider(settings) -> Iterator[FakeProviderServer]:
    """A fake provider on a free port, with the app's settings pointing at it."""
    server = FakeProviderServer(search_lag=0).start()
    settings.PAYMENTS = {**settings.PAYMENTS, **TEST_PAYMENTS, "PROVIDER_URL": server.url}
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    yield server
    server.stop()


def run_worker(queue: Queue) -> None:
    """Run jobs until the queue is empty, in this process (and this DB connection)."""
    SimpleWorker([queue], connection=queue.connection).work(burst=True, with_scheduler=False)
