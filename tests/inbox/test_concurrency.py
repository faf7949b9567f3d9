"""Two workers receive the same message at once: one runs it, the other waits, then skips."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from django.db import connection, connections
from rq import SimpleWorker
from rq.timeouts import TimerDeathPenalty

from inbox.models import InboxEntry
from inbox.queues import MessageQueue
from tests.support.inbox_jobs import QUEUE_NAME, handler_entered, release_handler, rendezvous_job


class ThreadWorker(SimpleWorker):
    """A real SimpleWorker that can run in a thread.

    Signal handlers and SIGALRM job timeouts only work in the main thread.
    """

    death_penalty_class = TimerDeathPenalty

    def _install_signal_handlers(self) -> None:
        pass


def work_one_job(queue: MessageQueue) -> threading.Thread:
    def run() -> None:
        try:
            ThreadWorker([queue], connection=queue.connection).work(burst=True, max_jobs=1)
        finally:
            # Each thread had its own database connection; close it.
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for_blocked_insert(timeout: float = 10.0) -> bool:
    """Poll PostgreSQL until a backend waits on a lock inside the inbox INSERT."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO \"inbox_inboxentry\"%'"
            )
            if cursor.fetchone()[0]:
                return True
        time.sleep(0.02)
    return False


# transaction=True: each worker thread has its own connection; the second one
# must block on the first one's uncommitted row and then see its commit.
@pytest.mark.django_db(transaction=True)
def test_same_message_twice_at_once__second_worker_waits_then_skips(
    queue: MessageQueue, effects, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox")
    handler_entered.clear()
    release_handler.clear()
    job = queue.enqueue(rendezvous_job, "a")
    queue.push_job_id(job.id)  # the same message delivered a second time

    first = work_one_job(queue)
    assert handler_entered.wait(timeout=10), "first worker never reached the handler"
    second = work_one_job(queue)
    # The second worker's INSERT ... ON CONFLICT waits for the first transaction.
    blocked = wait_for_blocked_insert()
    release_handler.set()
    first.join(timeout=30)
    second.join(timeout=30)

    assert blocked, "second worker never waited on the first one's inbox row"
    assert not first.is_alive() and not second.is_alive()
    assert effects.count() == 1
    assert InboxEntry.objects.filter(consumer=QUEUE_NAME, message_id=job.id).count() == 1
    assert caplog.messages.count(f"Skipping message {job.id} for {QUEUE_NAME}") == 1
