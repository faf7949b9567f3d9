"""What every business package does with the order an operation acts for (checkout, refunds).

Shared here because the business packages may not import each other (an
import-linter contract keeps them independent).
"""

from __future__ import annotations

from payments.models import Operation, Order
from payments.money import format_money


def lock_order(operation: Operation) -> None:
    """Lock the operation's order. Runs inside the caller's (the desk's) transaction."""
    Order.objects.select_for_update().filter(pk=operation.params.get("order_id")).first()


def money_line(operation: Operation, what: str) -> str:
    """One line for the desk: the money at stake, e.g. "€49.99 charge of order 42"."""
    money = format_money(operation.params.get("amount"), operation.params.get("currency"))
    return f"{money} {what} of order {operation.params.get('order_id')}"
