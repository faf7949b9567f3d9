"""Deliver operations to RQ. The operation row is the record; a job is only a delivery.

The job id (32 hex, also the message id) is written on the operation before
the enqueue, so the sweeper can tell a live delivery from a lost one. Inside a
transaction it is written in that transaction (no commit of its own) and the
job is enqueued once it commits.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from datetime import datetime

import django_rq
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from redis import Redis
from rq import Retry
from rq.queue import Queue

from payments.conf import payments_setting
from payments.models import Operation

logger = logging.getLogger("payments.dispatch")


@functools.cache
def _connection(url: str) -> Redis:
    """One connection pool per process and URL (redis-py resets it after a fork)."""
    return Redis.from_url(url)


def payments_queue() -> Queue:
    """Return the payments queue, reusing this process's Redis connection pool."""
    name = payments_setting("QUEUE")
    return django_rq.get_queue(name, connection=_connection(settings.RQ_QUEUES[name]["URL"]))


def _delivery(op: Operation) -> tuple[Callable[[int], str], str]:
    """Return the job function and a job id for one delivery of `op`."""
    # Imported here: both modules import this one.
    from payments.followups import FOLLOW_UPS, message_id_for
    from payments.jobs import deliver_follow_up, run_operation

    if op.kind in FOLLOW_UPS:
        # An inbox message: every delivery of it must carry the same id.
        return deliver_follow_up, message_id_for(op.key)
    # The fence guards operations; each delivery is a job of its own.
    return run_operation, uuid.uuid4().hex


def _enqueue(op: Operation, func: Callable[[int], str], job_id: str, at: datetime | None) -> None:
    queue = payments_queue()
    retries = payments_setting("MAX_ATTEMPTS") - 1
    options = {
        "job_id": job_id,
        "job_timeout": payments_setting("JOB_TIMEOUT"),
        "description": f"{op.kind} operation {op.pk}",
        "retry": Retry(max=retries, interval=payments_setting("RETRY_BACKOFF"))
        if retries
        else None,
    }
    if at is not None and at > timezone.now():
        queue.enqueue_at(at, func, op.pk, **options)
    else:
        queue.enqueue(func, op.pk, **options)


def dispatch(operation_id: int, *, at: datetime | None = None) -> str:
    """Record a new job id, then enqueue the job (at `at`, else now); return the job id."""
    op = Operation.objects.only("key", "kind").get(pk=operation_id)
    func, job_id = _delivery(op)
    Operation.objects.filter(pk=op.pk).update(job_id=job_id, dispatched_at=timezone.now())
    _enqueue(op, func, job_id, at)
    return job_id


def dispatch_on_commit(operation: Operation | int) -> None:
    """Record the job id in the caller's transaction; enqueue once it commits.

    Runs inside the caller's transaction. A lost enqueue (Redis down, a crash
    right after the commit) is delivered later by the sweeper.
    """
    op = (
        operation
        if isinstance(operation, Operation)
        else Operation.objects.only("key", "kind").get(pk=operation)
    )
    func, job_id = _delivery(op)
    Operation.objects.filter(pk=op.pk).update(job_id=job_id, dispatched_at=timezone.now())

    def deliver() -> None:
        try:
            _enqueue(op, func, job_id, None)
        except Exception:  # Redis down: the row is durable, the sweeper delivers it
            logger.warning(
                "enqueue of operation %s failed; the sweeper will deliver it",
                op.pk,
                exc_info=True,
            )

    transaction.on_commit(deliver)
