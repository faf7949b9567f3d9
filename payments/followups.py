"""Follow-ups of a paid order: local-only handlers behind the inbox.

The checkout's `mark_paid` step writes one operation row per follow-up in its
own transaction (the outbox, never an after-commit enqueue from a handler).
The dispatcher delivers each as an RQ message whose id is derived from the
operation key, so every redelivery (RQ retry, abandoned job, failed-registry
requeue, the sweeper) carries the same message id and the inbox runs the
handler once: its writes, its inbox row and the operation's `succeeded` commit
together. The writes here are deliberately not idempotent on their own (a
ledger line, a counter): the inbox is what keeps them exactly once.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models import F

from inbox.handlers import inbox_handler
from payments import fence
from payments.dispatch import dispatch_on_commit
from payments.models import LedgerEntry, Operation, OperationState, Order, SalesDay
from payments.runtime import retry_or_give_up

logger = logging.getLogger("payments.followups")
alerts = logging.getLogger("payments.alerts")

RECORD_SALE = "record_sale"
COUNT_SALE = "count_sale"


def message_id_for(operation_key: str) -> str:
    """Return the stable 32-hex message id of a follow-up operation."""
    return hashlib.sha256(operation_key.encode()).hexdigest()[:32]


def write_follow_ups_in_tx(order: Order, reference: str, *, parent_key: str, actor: str) -> None:
    """Write the paid order's follow-up operations. Runs inside the caller's transaction."""
    params = {
        "order_id": order.pk,
        "amount": order.amount,
        "currency": order.currency,
        "reference": reference,
    }
    for kind in FOLLOW_UPS:
        op, created = fence.create_operation_in_tx(
            key=f"{parent_key}:{kind}",
            kind=kind,
            entity_type="order",
            entity_id=order.pk,
            params=params,
            actor=actor,
        )
        if created:
            dispatch_on_commit(op)


@inbox_handler(consumer="ledger")
def _record_sale(operation_id: int, worker_id: str) -> str:
    op = fence.locked_operation_in_tx(operation_id)
    LedgerEntry.objects.create(
        order_id=op.params["order_id"],
        amount=op.params["amount"],
        currency=op.params["currency"],
        provider_reference=op.params["reference"],
    )
    return _succeed_in_tx(op, worker_id)


@inbox_handler(consumer="sales_stats")
def _count_sale(operation_id: int, worker_id: str) -> str:
    op = fence.locked_operation_in_tx(operation_id)
    day, _ = SalesDay.objects.get_or_create(
        day=op.created_at.date(), currency=op.params["currency"]
    )
    SalesDay.objects.filter(pk=day.pk).update(
        orders=F("orders") + 1, total=F("total") + op.params["amount"]
    )
    return _succeed_in_tx(op, worker_id)


#: kind -> inbox-protected handler taking (operation_id, worker_id).
FOLLOW_UPS: dict[str, Callable[[int, str], str | None]] = {
    RECORD_SALE: _record_sale,
    COUNT_SALE: _count_sale,
}


def _succeed_in_tx(op: Operation, worker_id: str) -> str:
    fence.transition_in_tx(
        op,
        OperationState.SUCCEEDED,
        actor=worker_id,
        reason="delivered",
        next_attempt_at=None,
    )
    return "delivered"


def deliver(operation_id: int, *, worker_id: str, job: Any = None) -> str:
    """Deliver one follow-up message: run its handler once, count failures, bound retries."""
    op = Operation.objects.get(pk=operation_id)
    handler = FOLLOW_UPS[op.kind]
    # No check of the operation's state here: the inbox decides, in the
    # handler's own transaction. A message requeued by an operator after its
    # attempts ran out has no inbox row (each attempt rolled back) and runs.
    try:
        outcome = handler(operation_id, worker_id)
    except Exception as exc:  # rolled back with its inbox row; count it outside
        return _failed_attempt(op, worker_id, f"{type(exc).__name__}: {exc}", job)
    if outcome is None:
        _settle_duplicate(op, worker_id)
        return "duplicate"
    return outcome


def _settle_duplicate(op: Operation, worker_id: str) -> None:
    """The inbox row proves the handler committed: its operation succeeded."""
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if locked.state != OperationState.SUCCEEDED:
            _succeed_in_tx(locked, worker_id)


def _failed_attempt(op: Operation, worker_id: str, reason: str, job: Any) -> str:
    """Count a failed delivery; schedule the next or give up visibly.

    Raises, unless the handler had committed already (the error came after,
    e.g. the job's time ran out on the way back): then it is delivered.
    """
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if locked.state == OperationState.SUCCEEDED:
            return "delivered"
        gave_up = fence.record_failed_attempt_in_tx(locked, actor=worker_id, reason=reason)
    retry_or_give_up(locked, gave_up=gave_up, reason=reason, job=job)
    return "unreachable"  # retry_or_give_up always raises
