"""What a refund request is checked against besides the amount: the order's status, and
the refunds its caller was shown. Both run under the order's lock (request_refund's).
"""

from __future__ import annotations

from payments.exceptions import UnseenOperation
from payments.models import Operation
from payments.refunds.names import REFUND
from payments.shop.models import Order, OrderStatus


def refuse_unseen_in_tx(order: Order, seen: int | None) -> None:
    """Raise UnseenOperation when the order has a refund newer than `seen`. In the caller's tx.

    `seen` is the id of the newest refund operation of the order the caller
    was shown (0: none); None does not check (the API: its key names the
    intent). Read under the order's lock, which every refund of the order is
    written under: of two pages posted at once, the second sees the first's.
    """
    if seen is None:
        return
    newest = (
        Operation.objects.filter(kind=REFUND, entity_type="order", entity_id=str(order.pk))
        .order_by("-pk")
        .only("pk", "key")
        .first()
    )
    if newest is not None and newest.pk > seen:
        raise UnseenOperation(operation_key=newest.key, operation_id=newest.pk)


def not_refundable(order: Order) -> str:
    """Why nothing of the order can be refunded in its status."""
    why = {
        OrderStatus.PENDING: "nothing was captured yet",
        OrderStatus.PROCESSING: "nothing was captured yet",
        OrderStatus.PAYMENT_FAILED: "nothing was charged",
        OrderStatus.REFUNDED: "everything was refunded already",
    }.get(OrderStatus(order.status), "it has no invoice")
    return (
        f"order {order.pk} is {OrderStatus(order.status).label.lower()}, nothing to refund: {why}"
    )
