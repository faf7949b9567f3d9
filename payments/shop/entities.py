"""What every shop operation does with the order it acts for (checkout, captures, refunds).

Shared here because the business packages may not import each other (an
import-linter contract keeps them independent).
"""

from __future__ import annotations

from typing import Final

from payments.fence import create_follow_ups_in_tx, kinds_following
from payments.models import Operation
from payments.money import format_money
from payments.shop.models import Order

#: The business event of an order paid, whatever paid it (a checkout, a capture). Each
#: package that has something to do then declares it on its operation,
#: `follows=Follows(ORDER_PAID)` (payments.fence): the checkout's ledger line and sales
#: counter (payments.checkout.followups), the invoice export (payments.invoices).
ORDER_PAID: Final = "order_paid"
#: The checkout's own confirmation e-mail: a follow-up of ORDER_PAID declared with
#: `replaces=ORDER_CONFIRMATION` (an e-mail provider's) sends it instead.
ORDER_CONFIRMATION: Final = "order_confirmation"


def write_follow_ups_in_tx(
    order: Order,
    reference: str,
    *,
    parent: Operation,
    actor: str,
    amount: int | None = None,
    made_by: tuple[str, ...] = (),
) -> None:
    """Write the paid order's follow-up operations. Runs inside the caller's transaction.

    Their keys are derived from the parent's id (scope DERIVED): whatever key a
    client chose, a follow-up's key fits and can never collide with a client's.
    Their INSERTs go in one round trip, their jobs in one Redis pipeline.
    `amount`: what was taken, when less than the order's amount (a partial capture).
    `made_by`: the follow-up kinds the writer recorded as making one of its effects
    instead of itself (the confirmation step's result's `sent_by`): of the kinds that
    replace an effect, only these are written (payments.engine.follow_ups).
    """
    params = {
        "order_id": order.pk,
        "amount": order.amount if amount is None else amount,
        "currency": order.currency,
        "reference": reference,
    }
    kinds = kinds_following(ORDER_PAID, made_by=made_by)
    create_follow_ups_in_tx(
        parent, kinds, entity_type="order", entity_id=order.pk, params=params, actor=actor
    )


def lock_order(operation: Operation) -> None:
    """Lock the operation's order. Runs inside the caller's (the desk's) transaction."""
    Order.objects.select_for_update().filter(pk=operation.params.get("order_id")).first()


def money_line(operation: Operation, what: str) -> str:
    """One line for the desk: the money at stake, e.g. "€49.99 charge of order 42"."""
    money = format_money(operation.params.get("amount"), operation.params.get("currency"))
    return f"{money} {what} of order {operation.params.get('order_id')}"
