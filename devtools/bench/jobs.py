"""Job functions the benchmark runs next to the real ones: the unfenced twins and no-ops.

Never used by the product. The unfenced checkout does the same business work
as the fenced `checkout` handler (charge, invoice, e-mail, paid, the ledger
line and the sales counter) with no lease, claim, event or inbox row: what the
fence is measured against. It gets the same plumbing as the fenced side: the
process's shared provider session, the process's Redis client. Its two
follow-ups go where the fence's go: written in the paid transaction while
PAYMENTS["INLINE_FOLLOW_UPS"] holds, else two jobs enqueued in one pipeline.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.utils import timezone

from inbox.handlers import inbox_handler
from payments.checkout.followups import add_to_sales_day
from payments.checkout.handler import issue_invoice, send_confirmation
from payments.conf import payments_settings
from payments.engine.queues import payments_queue
from payments.provider.client import ProviderClient
from payments.shop.models import LedgerEntry, Order, OrderStatus


def noop() -> None:
    """Do nothing: the queue's own ceiling."""


def settings_probe() -> dict[str, object]:
    """What a worker runs with: DEBUG, whether its queries are logged (DEBUG does that), and
    its database backend (the module of its connection's class)."""
    return {
        "debug": settings.DEBUG,
        "queries_logged": connection.queries_logged,
        "backend": type(connections[DEFAULT_DB_ALIAS]).__module__,
    }


def unfenced_checkout(order_id: int, payment_method: str) -> str:
    order = Order.objects.get(pk=order_id)
    intent = ProviderClient.from_settings().create_payment_intent(
        amount=order.amount,
        currency=order.currency,
        payment_method=payment_method,
        metadata={
            "operation_key": f"unfenced-{order_id}",
            "step": "charge",
            "order_id": str(order_id),
        },
        idempotency_key=uuid.uuid4().hex,
    )
    # The fenced handler's own business functions: the same invoice and the same e-mail
    # (its amount formatted for the customer); the same order update.
    with transaction.atomic():
        issue_invoice(order, intent.id)
    send_confirmation(order, intent.id)
    inline = payments_settings().inline_follow_ups
    with transaction.atomic():
        Order.objects.filter(pk=order_id).update(status=OrderStatus.PAID, updated_at=timezone.now())
        if inline:
            _record_sale(order, intent.id)
            add_to_sales_day(timezone.now().date(), order.currency, order.amount)
    if inline:
        return intent.id
    queue = payments_queue()
    follow_ups = [
        queue.prepare_data(unfenced_record_sale, (order_id, intent.id)),
        queue.prepare_data(unfenced_count_sale, (order_id,)),
    ]
    with queue.connection.pipeline() as pipe:
        queue.enqueue_many(follow_ups, pipeline=pipe)
        pipe.execute()
    return intent.id


def unfenced_record_sale(order_id: int, reference: str) -> None:
    order = Order.objects.get(pk=order_id)
    with transaction.atomic():
        _record_sale(order, reference)


def _record_sale(order: Order, reference: str) -> None:
    LedgerEntry.objects.create(
        order=order, amount=order.amount, currency=order.currency, provider_reference=reference
    )


def unfenced_count_sale(order_id: int) -> None:
    order = Order.objects.get(pk=order_id)
    with transaction.atomic():
        add_to_sales_day(timezone.now().date(), order.currency, order.amount)


def _write_ledger_line(order_id: int) -> None:
    LedgerEntry.objects.create(
        order_id=order_id, amount=1, currency="eur", provider_reference="bench"
    )


def local_unprotected(order_id: int) -> None:
    """A local handler in its own transaction, without the inbox."""
    with transaction.atomic():
        _write_ledger_line(order_id)


@inbox_handler(consumer="bench")
def local_protected(order_id: int) -> None:
    """The same handler behind the inbox (its row commits with the write)."""
    _write_ledger_line(order_id)
