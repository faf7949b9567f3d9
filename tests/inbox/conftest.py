"""Fixtures for the inbox tests: real PostgreSQL, real Redis (a database of its own)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import django_rq
import pytest
from django.db import connection
from redis import Redis
from rq import SimpleWorker

from inbox.queues import MessageQueue
from tests.inbox.jobs import EFFECT_TABLE, QUEUE_NAME, SEEN_KEY

# Database 14 is reserved for these tests and flushed around each one.
REDIS_URL = os.environ.get("INBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")


@pytest.fixture
def redis_conn() -> Iterator[Redis]:
    conn = Redis.from_url(REDIS_URL)
    conn.flushdb()
    yield conn
    conn.flushdb()
    conn.close()


@pytest.fixture
def queue(redis_conn: Redis, settings) -> MessageQueue:
    """Return the test queue, built by django-rq from settings like production queues.

    Commit mode "auto": under ``django_db`` the test runs in a transaction
    that never commits, so on_commit enqueues would never happen.
    """
    settings.RQ_QUEUES = {
        **settings.RQ_QUEUES,
        QUEUE_NAME: {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 30},
    }
    q = django_rq.get_queue(QUEUE_NAME, connection=redis_conn, commit_mode="auto")
    assert isinstance(q, MessageQueue)
    return q


def run_worker(queue: MessageQueue, *, with_scheduler: bool = False) -> None:
    """Run a real rq SimpleWorker in this process until the queue is empty."""
    # work() installs its own SIGINT/SIGTERM handlers; give pytest its own back.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        SimpleWorker([queue], connection=queue.connection).work(
            burst=True, with_scheduler=with_scheduler
        )
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


class Effects:
    """The side table handlers write to, so exactly-once is counted in the database."""

    def count(self, tag: str | None = None) -> int:
        with connection.cursor() as cursor:
            if tag is None:
                cursor.execute(f"SELECT count(*) FROM {EFFECT_TABLE}")
            else:
                cursor.execute(f"SELECT count(*) FROM {EFFECT_TABLE} WHERE tag = %s", [tag])
            return cursor.fetchone()[0]


@pytest.fixture
def effects() -> Iterator[Effects]:
    """Create the side table (raw SQL: the inbox app has no test models), drop it after."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {EFFECT_TABLE} "
            "(id bigserial PRIMARY KEY, message_id text, tag text NOT NULL)"
        )
    yield Effects()
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {EFFECT_TABLE}")


@pytest.fixture
def seen(redis_conn: Redis):
    """Return a function listing every delivery the handlers noted, in order."""

    def deliveries() -> list[dict[str, str]]:
        return [json.loads(item) for item in redis_conn.lrange(SEEN_KEY, 0, -1)]

    return deliveries
