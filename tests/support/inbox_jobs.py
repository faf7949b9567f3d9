"""RQ job functions for the inbox tests; a real module so worker processes can import them.

Jobs are stored in Redis by their path (``tests.support.inbox_jobs.effect_job``),
so `tests.support.inbox_worker`, run in a process of its own, finds them here.

Crashes are injected at named points: ``arm_crash(redis, point, times)``
makes the next ``times`` passes through ``crash_at(point)`` fail. By default
the failure is an exception (the worker records the job as failed); with
``INBOX_TEST_HARD_CRASH=1`` in the environment it is a SIGKILL of the worker
process itself, as when a machine dies.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import cast

import django_rq
from django.db import connection
from redis import Redis
from rq import get_current_job
from rq.job import Job

from inbox.handlers import inbox_handler

QUEUE_NAME = "inbox-test"
EFFECT_TABLE = "inbox_test_effect"
SEEN_KEY = "inbox-test:seen"
CRASH_KEY = "inbox-test:crash:{point}"

BEFORE_COMMIT = "before_commit"
AFTER_COMMIT = "after_commit"

# Rendezvous for the concurrency test; only the in-process handler uses them.
handler_entered = threading.Event()
release_handler = threading.Event()


class SimulatedCrash(RuntimeError):
    """Stands for a worker dying at a named point."""


def this_job() -> Job:
    """Return the job this code runs in (these helpers run only inside a worker's job)."""
    job = get_current_job()
    if job is None:
        raise RuntimeError("not inside an RQ job")
    return job


def arm_crash(redis: Redis, point: str, times: int = 1) -> None:
    """Make the next ``times`` passes through ``point`` crash."""
    redis.set(CRASH_KEY.format(point=point), times)


def crash_at(point: str) -> None:
    """Crash here if a crash is armed for ``point``."""
    # A sync client: redis-py's annotations also allow the asyncio client's Awaitable.
    left = cast(int, this_job().connection.decr(CRASH_KEY.format(point=point)))
    if left < 0:
        return
    if os.environ.get("INBOX_TEST_HARD_CRASH") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    raise SimulatedCrash(point)


def write_effect(tag: str) -> None:
    """Write the handler's business effect: one row in the side table."""
    job = get_current_job()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {EFFECT_TABLE} (message_id, tag) VALUES (%s, %s)",
            [job.meta.get("message_id") if job else None, tag],
        )


def note_delivery() -> None:
    """Note in Redis what this delivery carried; survives the DB rollback of a crash."""
    job = this_job()
    job.connection.rpush(
        SEEN_KEY,
        json.dumps(
            {
                "job_id": job.id,
                "message_id": job.meta.get("message_id"),
                "consumer": job.meta.get("consumer"),
            }
        ),
    )


@inbox_handler()
def effect_job(tag: str) -> str:
    """Write one effect; crash before commit when armed."""
    note_delivery()
    write_effect(tag)
    crash_at(BEFORE_COMMIT)
    return tag


def effect_then_ack_job(tag: str) -> str | None:
    """Run ``effect_job`` and crash after its commit, before the ack, when armed."""
    result = effect_job(tag)
    crash_at(AFTER_COMMIT)
    return result


@inbox_handler(consumer="explicit-consumer")
def explicit_consumer_job(tag: str) -> str:
    write_effect(tag)
    return tag


@inbox_handler()
def follow_up_job(tag: str) -> None:
    """Write an effect, then try the refused follow-up enqueue."""
    write_effect(tag)
    django_rq.get_queue(QUEUE_NAME, connection=this_job().connection).enqueue(
        effect_job, f"{tag}-follow-up"
    )


@inbox_handler()
def rendezvous_job(tag: str) -> str:
    """Write an effect, then hold the transaction open until the test releases it."""
    write_effect(tag)
    handler_entered.set()
    if not release_handler.wait(timeout=30):
        raise TimeoutError("the test never released the handler")
    return tag


class Effects:
    """The side table handlers write to, so exactly-once is counted in the database."""

    def count(self, tag: str | None = None) -> int:
        with connection.cursor() as cursor:
            if tag is None:
                cursor.execute(f"SELECT count(*) FROM {EFFECT_TABLE}")
            else:
                cursor.execute(f"SELECT count(*) FROM {EFFECT_TABLE} WHERE tag = %s", [tag])
            return cursor.fetchone()[0]
