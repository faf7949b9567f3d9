"""Follow-ups of a paid order: local-only message handlers behind the inbox.

The checkout's `mark_paid` step writes one operation row per follow-up in its
own transaction (the outbox, never an after-commit enqueue from a handler).
The engine delivers each as an RQ message whose id is derived from the
operation key, so every redelivery carries the same message id and the inbox
runs the handler once: its writes, its inbox row and the operation's
`succeeded` commit together. The writes here are deliberately not idempotent
on their own (a ledger line, a counter): the inbox is what keeps them exactly
once.
"""

from __future__ import annotations

from django.db.models import F

from payments.checkout.names import (
    COUNT_SALE,
    LEDGER_CONSUMER,
    RECORD_SALE,
    SALES_STATS_CONSUMER,
)
from payments.engine import fence
from payments.engine.dispatch import create_and_dispatch_all_in_tx
from payments.engine.handlers import message_handler
from payments.models import KeyScope, LedgerEntry, Operation, Order, SalesDay

#: The follow-ups written for every paid order, in this order.
FOLLOW_UPS = (RECORD_SALE, COUNT_SALE)


def write_follow_ups_in_tx(order: Order, reference: str, *, parent: Operation, actor: str) -> None:
    """Write the paid order's follow-up operations. Runs inside the caller's transaction.

    Their keys are derived from the parent's id (scope DERIVED): whatever key a
    client chose, a follow-up's key fits and can never collide with a client's.
    Their INSERTs go in one round trip, their jobs in one Redis pipeline.
    """
    params = {
        "order_id": order.pk,
        "amount": order.amount,
        "currency": order.currency,
        "reference": reference,
    }
    create_and_dispatch_all_in_tx(
        [
            fence.NewOperation(
                key=fence.follow_up_key(parent, kind),
                scope=KeyScope.DERIVED,
                parent=parent,
                kind=kind,
                entity_type="order",
                entity_id=order.pk,
                params=params,
                actor=actor,
            )
            for kind in FOLLOW_UPS
        ]
    )


@message_handler(RECORD_SALE, consumer=LEDGER_CONSUMER)
def record_sale(op: Operation) -> None:
    """Write the order's sales-ledger line. Runs in the message's inbox transaction."""
    LedgerEntry.objects.create(
        order_id=op.params["order_id"],
        amount=op.params["amount"],
        currency=op.params["currency"],
        provider_reference=op.params["reference"],
    )


@message_handler(COUNT_SALE, consumer=SALES_STATS_CONSUMER)
def count_sale(op: Operation) -> None:
    """Add the order to its day's sales counter. Runs in the message's inbox transaction."""
    day, _ = SalesDay.objects.get_or_create(
        day=op.created_at.date(), currency=op.params["currency"]
    )
    SalesDay.objects.filter(pk=day.pk).update(
        orders=F("orders") + 1, total=F("total") + op.params["amount"]
    )
