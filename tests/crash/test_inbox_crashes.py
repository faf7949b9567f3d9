"""A real worker process dies mid-job (SIGKILL); RQ hands the job back; effects stay once.

transaction=True throughout: the worker process has its own database
connection and must see the committed tables, and its commit (or the
rollback of its killed transaction) must be visible to this process.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import cast

import pytest
from rq import Retry
from rq.job import JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry

from inbox.models import InboxEntry
from inbox.queues import MessageQueue
from tests.support.config import TEST_REDIS_URL
from tests.support.inbox_jobs import (
    AFTER_COMMIT,
    BEFORE_COMMIT,
    QUEUE_NAME,
    arm_crash,
    effect_job,
    effect_then_ack_job,
)
from tests.support.workers import ROOT, database_url, run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def run_worker_process_until_killed() -> None:
    """Run a real worker process that SIGKILLs itself at the armed crash point."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": database_url(),
        "INBOX_TEST_HARD_CRASH": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.inbox_worker", TEST_REDIS_URL],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def expire_leases(queue: MessageQueue) -> None:
    """Let the dead worker's leases run out now instead of in 60-90 s, then clean up.

    The cleanup is rq's own: it retries an abandoned job (same id) while
    retries are left, else moves it to the failed registry.
    """
    registry = StartedJobRegistry(queue=queue)
    # A sync client: redis-py's annotations also allow the asyncio client's Awaitable.
    for member in cast("list[bytes]", queue.connection.zrange(registry.key, 0, -1)):
        queue.connection.zadd(registry.key, {member: 1})
    registry.cleanup()


def test_killed_before_commit__abandoned_retry_runs_effect_once(
    inbox_queue: MessageQueue, effects, seen
) -> None:
    arm_crash(inbox_queue.connection, BEFORE_COMMIT)
    job = inbox_queue.enqueue(effect_job, "a", retry=Retry(max=1))

    run_worker_process_until_killed()
    # The killed transaction rolled back: no effect, no inbox row.
    assert effects.count() == 0
    assert not InboxEntry.objects.exists()

    expire_leases(inbox_queue)
    assert inbox_queue.job_ids == [job.id]
    run_worker(inbox_queue)

    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert effects.count() == 1
    assert list(InboxEntry.objects.values_list("consumer", "message_id")) == [(QUEUE_NAME, job.id)]
    assert [d["message_id"] for d in seen()] == [job.id, job.id]


def test_killed_after_commit__requeued_job_is_skipped(
    inbox_queue: MessageQueue, effects, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox")
    arm_crash(inbox_queue.connection, AFTER_COMMIT)
    job = inbox_queue.enqueue(effect_then_ack_job, "a")

    run_worker_process_until_killed()
    assert effects.count() == 1  # committed before the kill

    expire_leases(inbox_queue)  # no retries left: the abandoned job lands in the failed registry
    registry = FailedJobRegistry(queue=inbox_queue)
    assert job.id in registry.get_job_ids()
    registry.requeue(job.id)
    run_worker(inbox_queue)

    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert effects.count() == 1
    assert InboxEntry.objects.count() == 1
    assert f"Skipping message {job.id} for {QUEUE_NAME}" in caplog.messages
