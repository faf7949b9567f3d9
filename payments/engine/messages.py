"""Deliver a message handler's operation behind the inbox: once, with bounded retries.

A message handler (`payments.engine.handlers.message_handler`) is local-only:
its writes, its inbox row and its operation's `succeeded` commit in one
transaction. The dispatcher gives every delivery of one operation the same
message id (derived from the operation's key, see dispatch.message_id_for), so every redelivery (RQ retry,
abandoned job, failed-registry requeue, the sweeper) is skipped by the inbox.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from payments.engine import fence
from payments.engine.handlers import get_handler, succeed_message_in_tx
from payments.engine.runtime import next_try
from payments.models import Operation, OperationState


def deliver(operation_id: int, *, worker_id: str, job: Any = None, kind: str | None = None) -> str:
    """Deliver one message: run its handler once, count failures, bound retries.

    `kind` comes from the job (dispatch writes it there); without it the row is
    read first. The handler's own statement checks it against the row.
    """
    if kind is None:
        kind = Operation.objects.values_list("kind", flat=True).get(pk=operation_id)
    spec = get_handler(kind)
    # No check of the operation's state here: the inbox decides, in the
    # handler's own transaction. A message requeued by an operator after its
    # attempts ran out has no inbox row (each attempt rolled back) and runs.
    try:
        outcome = spec.func(operation_id, worker_id)
    except Exception as exc:  # rolled back with its inbox row; count it outside
        return _failed_attempt(operation_id, worker_id, f"{type(exc).__name__}: {exc}", job)
    if outcome is None:
        _settle_duplicate(operation_id, worker_id)
        return "duplicate"
    return str(outcome)


def _settle_duplicate(operation_id: int, worker_id: str) -> None:
    """The inbox row proves the handler committed: its operation succeeded."""
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(operation_id)
        if locked.state != OperationState.SUCCEEDED:
            succeed_message_in_tx(locked.pk, worker_id)


def _failed_attempt(operation_id: int, worker_id: str, reason: str, job: Any) -> str:
    """Count a failed delivery; schedule the next or give up visibly.

    Raises RQ's next try (or its giving up), unless the handler had committed already
    (the error came after, e.g. the job's time ran out on the way back): then it is
    delivered.
    """
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(operation_id)
        if locked.state == OperationState.SUCCEEDED:
            return "delivered"
        gave_up = fence.record_failed_attempt_in_tx(locked, actor=worker_id, reason=reason)
    raise next_try(locked, gave_up=gave_up, reason=reason, job=job)
