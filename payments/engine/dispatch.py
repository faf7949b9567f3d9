"""Deliver operations to RQ. The operation row is the record; a job is only a delivery.

The job id (32 hex, also the message id) is written on the operation before
the enqueue, so the sweeper can tell a live delivery from a lost one. Inside a
transaction it is written in that transaction (no commit of its own) and the
job is enqueued once it commits.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from datetime import datetime

from django.db import transaction
from django.utils import timezone
from rq import Retry

from payments.conf import payments_settings
from payments.engine import fence
from payments.engine.handlers import get_handler
from payments.engine.queues import payments_queue
from payments.exceptions import ConfigurationError
from payments.models import KeyScope, Operation

logger = logging.getLogger("payments.engine.dispatch")


def message_id_for(operation_key: str, scope: str = KeyScope.CLIENT) -> str:
    """Return the stable 32-hex message id of a message operation (the same on every delivery)."""
    name = operation_key if scope == KeyScope.CLIENT else f"{scope}\x1e{operation_key}"
    return hashlib.sha256(name.encode()).hexdigest()[:32]


#: The RQ entry points, named by path: RQ stores the path with the job, and
#: naming them keeps this module free of an import of the jobs (which import it).
RUN_OPERATION = "payments.engine.jobs.run_operation"
DELIVER_MESSAGE = "payments.engine.jobs.deliver_message"


def _delivery(op: Operation) -> tuple[str, str]:
    """Return the job function's path and a job id for one delivery of `op`."""
    try:
        consumer = get_handler(op.kind).consumer
    except ConfigurationError:  # no handler: run_operation parks it in needs_review
        consumer = None
    if consumer is not None:
        # An inbox message: every delivery of it must carry the same id.
        return DELIVER_MESSAGE, message_id_for(op.key, op.scope)
    # The fence guards operations; each delivery is a job of its own.
    return RUN_OPERATION, uuid.uuid4().hex


def _enqueue(op: Operation, func: str, job_id: str, at: datetime | None) -> None:
    queue = payments_queue()
    retries = payments_settings().max_attempts - 1
    options = {
        "job_id": job_id,
        "job_timeout": payments_settings().job_timeout,
        "description": f"{op.kind} operation {op.pk}",
        "retry": Retry(max=retries, interval=list(payments_settings().retry_backoff))
        if retries
        else None,
    }
    if at is not None and at > timezone.now():
        queue.enqueue_at(at, func, op.pk, **options)
    else:
        queue.enqueue(func, op.pk, **options)


def dispatch(operation_id: int, *, at: datetime | None = None) -> str:
    """Record a new job id, then enqueue the job (at `at`, else now); return the job id."""
    op = Operation.objects.only("key", "kind", "scope").get(pk=operation_id)
    func, job_id = _delivery(op)
    fence.record_dispatch_in_tx(op.pk, job_id)
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
        else Operation.objects.only("key", "kind", "scope").get(pk=operation)
    )
    func, job_id = _delivery(op)
    fence.record_dispatch_in_tx(op.pk, job_id)

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
