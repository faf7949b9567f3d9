"""The `capture` operation: authorise the order's amount, capture part or all, record it.

    authorize   a hold on the card (capture_method=manual)
    capture     the amount to capture (the rest of the hold is released)
    record      the invoice of the captured amount; the order is paid

When the capture gives up after the hold was made, `release` cancels the
intent (a step of its own, with its own claim and key), so no money stays
held on the customer's card; the order's payment then fails.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from payments.adyen.choice import system_params
from payments.captures.effects import AUTHORIZE, Authorization, Capture, Release
from payments.exceptions import InvalidTransition
from payments.fence import Desk, Run, create_operation_in_tx, operation
from payments.models import ApiClient, KeyScope, Operation, tenant_of
from payments.money import format_money
from payments.shop.entities import lock_order, write_follow_ups_in_tx
from payments.shop.models import Invoice, Order, OrderStatus

CAPTURE = "capture"
CAPTURE_STEP = "capture"
RELEASE = "release"
RECORD = "record"


class CaptureNotAllowed(InvalidTransition):
    """The order was paid or tried before, or the amount to capture exceeds its amount."""


def request_capture(
    *,
    order_id: int,
    key: str,
    payment_method: str,
    amount_to_capture: int | None = None,
    actor: str,
    client: ApiClient | None = None,
) -> tuple[Operation, bool]:
    """Write the capture operation of a new order and enqueue it on commit; (op, created).

    Only an order never tried (pending): its one intent is the hold. The same
    key replays; with other parameters it raises OperationConflict.
    """
    with transaction.atomic():
        order = Order.objects.select_for_update().get(pk=order_id)
        amount = order.amount if amount_to_capture is None else int(amount_to_capture)
        params = {
            "order_id": order.pk,
            "amount": order.amount,
            "currency": order.currency,
            "payment_method": payment_method,
            "amount_to_capture": amount,
            **system_params(client),
        }
        known = Operation.objects.filter(
            tenant=tenant_of(client), scope=KeyScope.CLIENT, key=key
        ).exists()
        if not known and order.status != OrderStatus.PENDING:
            raise CaptureNotAllowed(f"order {order.pk} is {order.status}; it cannot be captured")
        if not 0 < amount <= order.amount:
            raise CaptureNotAllowed(f"order {order.pk} holds {order.amount}, not {amount}")
        op, created = create_operation_in_tx(
            key=key,
            kind=CAPTURE,
            entity_type="order",
            entity_id=order.pk,
            params=params,
            actor=actor,
            tenant=tenant_of(client),
        )
        if created:
            order.status = OrderStatus.PROCESSING
            order.save(update_fields=["status", "updated_at"])
    return op, created


def record_capture(order: Order, captured: dict[str, Any], operation: Operation) -> dict[str, Any]:
    """Invoice the captured amount, mark the order paid, write its follow-ups (ledger, sales).
    Runs in the step's transaction. The invoice carries the intent: refunds are limited to
    what it says was captured."""
    invoice = Invoice.objects.create(
        order=order,
        number=f"INV-{order.pk:08d}",
        amount=int(captured["amount"]),
        currency=order.currency,
        provider_reference=captured["payment_intent"],
    )
    Order.objects.filter(pk=order.pk).update(status=OrderStatus.PAID, updated_at=timezone.now())
    reference = captured["payment_intent"]
    write_follow_ups_in_tx(order, reference, parent=operation, actor=CAPTURE, amount=invoice.amount)
    return {"invoice": invoice.number, "captured": invoice.amount}


def release_hold(run: Run) -> None:
    """Compensate a capture that gave up: cancel the intent, releasing the hold."""
    run.external(RELEASE)


def describe(operation: Operation) -> str:
    """The desk's money line: what was captured once it was, else what is held or asked."""
    params, claim = operation.params, operation.claims.filter(step=CAPTURE_STEP).first()
    captured = (claim.result or {}).get("amount") if claim and claim.state == "done" else None
    held = format_money(params.get("amount"), params.get("currency"))
    if captured is None:
        wanted = format_money(params.get("amount_to_capture"), params.get("currency"))
        return f"{wanted} capture of a {held} hold, order {params.get('order_id')}"
    money = format_money(captured, params.get("currency"))
    return f"{money} captured of a {held} hold, order {params.get('order_id')}"


def mark_failed(operation: Operation) -> None:
    """The order's payment failed (declined, or released). In the failing transaction."""
    Order.objects.filter(pk=operation.params["order_id"], status=OrderStatus.PROCESSING).update(
        status=OrderStatus.PAYMENT_FAILED, updated_at=timezone.now()
    )


@operation(
    CAPTURE,
    entity=Order,
    steps={AUTHORIZE: Authorization, CAPTURE_STEP: Capture, RELEASE: Release, RECORD: None},
    on_give_up=release_hold,  # runs run.external(RELEASE): its own claim and key
    on_failure=mark_failed,
    desk=Desk(lock_entity=lock_order, describe=describe),
)
def capture_order(run: Run) -> None:
    """Hold the order's amount, capture what the shop asked for, invoice it."""
    run.external(AUTHORIZE)  # claim committed, then the provider called with a stable key
    captured = run.external(CAPTURE_STEP)  # Capture reads the hold: run.result(AUTHORIZE)
    # The step's writes and its claim commit together, once.
    run.local(RECORD, lambda: record_capture(run.entity, captured, run.operation))
