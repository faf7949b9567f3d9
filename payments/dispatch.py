"""Deliver operations to RQ. The operation row is the record; a job is only a delivery.

The job id (32 hex, also the message id) is written on the operation before
the enqueue, so the sweeper can tell a live delivery from a lost one.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime

import django_rq
from django.db import transaction
from django.utils import timezone
from rq import Retry

from payments.conf import payments_setting
from payments.models import Operation

logger = logging.getLogger("payments.dispatch")


def dispatch(operation_id: int, *, at: datetime | None = None) -> str:
    """Enqueue a job that runs the operation (at `at`, else now); return the job id."""
    # Imported here: both modules import this one.
    from payments.followups import FOLLOW_UPS, message_id_for
    from payments.jobs import deliver_follow_up, run_operation

    op = Operation.objects.only("key", "kind").get(pk=operation_id)
    if op.kind in FOLLOW_UPS:
        # An inbox message: every delivery of it must carry the same id.
        func, job_id = deliver_follow_up, message_id_for(op.key)
    else:
        # The fence guards operations; each delivery is a job of its own.
        func, job_id = run_operation, uuid.uuid4().hex
    Operation.objects.filter(pk=operation_id).update(job_id=job_id, dispatched_at=timezone.now())
    queue = django_rq.get_queue(payments_setting("QUEUE"))
    retries = payments_setting("MAX_ATTEMPTS") - 1
    options = {
        "job_id": job_id,
        "job_timeout": payments_setting("JOB_TIMEOUT"),
        "description": f"{op.kind} operation {operation_id}",
        "retry": Retry(max=retries, interval=payments_setting("RETRY_BACKOFF"))
        if retries
        else None,
    }
    if at is not None and at > timezone.now():
        queue.enqueue_at(at, func, operation_id, **options)
    else:
        queue.enqueue(func, operation_id, **options)
    return job_id


def dispatch_on_commit(operation_id: int) -> None:
    """Enqueue after the surrounding transaction commits; a lost enqueue is swept later."""

    def deliver() -> None:
        try:
            dispatch(operation_id)
        except Exception:  # Redis down: the row is durable, the sweeper delivers it
            logger.warning(
                "enqueue of operation %s failed; the sweeper will deliver it",
                operation_id,
                exc_info=True,
            )

    transaction.on_commit(deliver)
