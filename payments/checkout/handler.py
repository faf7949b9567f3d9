"""The built-in `checkout` operation: charge -> invoice -> confirmation e-mail -> paid.

Paying the order also writes its follow-ups (ledger line, sales counter) as
operation rows in the same transaction; see payments.checkout.followups.

`request_checkout` is what the synchronous API calls: it writes the operation
in the same transaction as the order's change and enqueues on commit. The
charge itself runs in a worker, in `checkout`.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.mail import send_mail
from django.db import transaction
from django.db.models import CharField, Exists, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Cast
from django.utils import timezone

from payments.adyen.choice import system_params
from payments.checkout.charge import OrderCharge
from payments.checkout.followups import write_follow_ups_in_tx
from payments.checkout.names import CHARGE, CHECKOUT, CONFIRMATION_EMAIL, INVOICE, MARK_PAID
from payments.exceptions import InvalidTransition
from payments.fence import (
    DeliveryPolicy,
    Desk,
    Run,
    create_operation_in_tx,
    money_steps,
    operation,
    replaced_by,
)
from payments.models import (
    ApiClient,
    ClaimState,
    KeyScope,
    Operation,
    OperationState,
    StepClaim,
    tenant_of,
)
from payments.money import format_money
from payments.shop.entities import ORDER_CONFIRMATION, ORDER_PAID, lock_order, money_line
from payments.shop.models import Invoice, Order, OrderStatus

logger = logging.getLogger("payments.checkout.handler")

CHECKOUT_OPEN_STATUSES = frozenset({OrderStatus.PENDING, OrderStatus.PAYMENT_FAILED})


class CheckoutNotAllowed(InvalidTransition):
    """The order is already being paid or paid: a new key cannot start a second charge."""


def request_checkout(
    *,
    order_id: int,
    key: str,
    payment_method: str,
    actor: str,
    retry_of: Operation | None = None,
    scope: str = KeyScope.CLIENT,
    client: ApiClient | None = None,
) -> tuple[Operation, bool]:
    """Write the checkout operation for an order and enqueue it on commit.

    Returns (operation, created). The same key with the same parameters returns
    the existing operation and enqueues nothing; with other parameters it raises
    OperationConflict. A new key for an order that is not open for checkout
    raises CheckoutNotAllowed. Raises Order.DoesNotExist for an unknown order.
    """
    with transaction.atomic():
        # One read: the order (locked), whether the key is known, whether an
        # earlier charge of the order may have taken money.
        order = (
            Order.objects.select_for_update(of=("self",))
            .annotate(
                key_known=Exists(_with_key(client, scope, key)),
                earlier_charge_unsettled=Exists(_unsettled_charges(OuterRef("pk"))),
                latest_attempt=Subquery(_attempts(OuterRef("pk")).order_by("-pk").values("pk")[:1]),
            )
            .get(pk=order_id)
        )
        params = {
            "order_id": order.pk,
            "amount": order.amount,
            "currency": order.currency,
            "payment_method": payment_method,
            **system_params(client),
        }
        # The two Exists() read the statement's snapshot, taken before it waited
        # for the order's lock; the order's own columns are re-read after the
        # wait. A refusal is therefore confirmed by a fresh read first: a retry
        # of a key committed while this request waited replays, not 409.
        closed = order.status not in CHECKOUT_OPEN_STATUSES
        if (
            not order.key_known
            and (closed or order.earlier_charge_unsettled)
            and not _with_key(client, scope, key).exists()
        ):
            if closed:
                raise CheckoutNotAllowed(
                    f"order {order.pk} is {order.status}; it cannot be checked out"
                )
            if _unsettled_charges(order.pk).exists():
                raise CheckoutNotAllowed(
                    f"an earlier payment attempt of order {order.pk} may still have charged; "
                    "it must be settled first"
                )
        if retry_of is None and order.latest_attempt is not None:
            # A new key for an order tried before is its next attempt: it confirms the
            # order's PaymentIntent (payments.checkout.charge), never a second one.
            retry_of = Operation.objects.get(pk=order.latest_attempt)
        op, created = create_operation_in_tx(
            key=key,
            kind=CHECKOUT,
            entity_type="order",
            entity_id=order.pk,
            params=params,
            actor=actor,
            retry_of=retry_of,
            scope=scope,
            tenant=tenant_of(client),
        )
        if created:
            order.status = OrderStatus.PROCESSING
            order.save(update_fields=["status", "updated_at"])
    return op, created


def _with_key(client: ApiClient | None, scope: str, key: str) -> QuerySet[Operation]:
    """The operation a client's key names (none or one)."""
    return Operation.objects.filter(tenant=tenant_of(client), scope=scope, key=key)


def _attempts(order_id: Any) -> QuerySet[Operation]:
    """The order's checkout operations, one per payment attempt."""
    return Operation.objects.filter(
        kind=CHECKOUT, entity_type="order", entity_id=Cast(order_id, CharField())
    )


def _unsettled_charges(order_id: Any) -> QuerySet[StepClaim]:
    """The order's claims of steps that take money (a charge of any attempt, a capture) that
    did not fail: each took money, or may have."""
    takes_money = Q(pk__in=[])
    for kind, step in money_steps():
        takes_money |= Q(operation__kind=kind, step=step)
    return StepClaim.objects.filter(
        takes_money,
        operation__entity_type="order",
        operation__entity_id=Cast(order_id, CharField()),
    ).exclude(state=ClaimState.FAILED)


def reopen_order(operation: Operation) -> None:
    """Put a failed order back in processing. Runs in the transaction that resumes it."""
    Order.objects.filter(pk=operation.params["order_id"], status=OrderStatus.PAYMENT_FAILED).update(
        status=OrderStatus.PROCESSING, updated_at=timezone.now()
    )


def mark_order_failed(operation: Operation) -> None:
    """Mark the order's payment failed. Runs inside the transaction that fails the operation."""
    Order.objects.filter(pk=operation.params["order_id"], status=OrderStatus.PROCESSING).update(
        status=OrderStatus.PAYMENT_FAILED
    )


def issue_invoice(order: Order, reference: str) -> dict[str, Any]:
    """Create the order's invoice. Runs inside the step's transaction."""
    invoice = Invoice.objects.create(
        order=order,
        number=f"INV-{order.pk:08d}",
        amount=order.amount,
        currency=order.currency,
        provider_reference=reference,
    )
    return {"invoice": invoice.number}


def send_confirmation(order: Order, reference: str) -> dict[str, Any]:
    """Send the order confirmation e-mail, unless a follow-up of the paid order sends it
    instead (declared `Follows(ORDER_PAID, replaces=ORDER_CONFIRMATION)`: an e-mail
    provider's package), then recorded as the step's result."""
    sender = replaced_by(ORDER_PAID, ORDER_CONFIRMATION)
    if sender is not None:
        return {"sent": False, "sent_by": sender}
    amount = format_money(order.amount, order.currency)  # JPY has no minor unit, KWD three
    send_mail(
        subject=f"Order {order.pk} is paid",
        message=f"We received your payment of {amount} (reference {reference}).",
        from_email=None,
        recipient_list=[order.customer_email],
    )
    return {"sent": True}


def mark_paid(
    order: Order, reference: str, operation: Operation, confirmation: dict[str, Any]
) -> dict[str, Any]:
    """Mark the order paid and write its follow-ups: among them the one that sent the
    confirmation instead of the checkout, where that step recorded one (`sent_by`),
    whatever the settings say now. Runs inside the step's transaction."""
    Order.objects.filter(pk=order.pk).update(status=OrderStatus.PAID, updated_at=timezone.now())
    sent_by = confirmation.get("sent_by")
    made_by = (str(sent_by),) if sent_by else ()
    write_follow_ups_in_tx(order, reference, parent=operation, actor="checkout", made_by=made_by)
    return {"status": OrderStatus.PAID}


# --- what the operators' desk needs (payments.fence.Desk) -------------


def _order_status(operation: Operation) -> str | None:
    """The order's status, unless it is payment failed (open for a charge); "missing"."""
    order = Order.objects.filter(pk=operation.params.get("order_id")).first()
    if order is None:
        return "missing"
    return None if order.status == OrderStatus.PAYMENT_FAILED else order.status


def refuse_charging_again(operation: Operation) -> str | None:
    """Why this failed checkout may not run again: the order moved on without it, or None."""
    newer = (
        Operation.objects.filter(
            kind=operation.kind, entity_type=operation.entity_type, entity_id=operation.entity_id
        )
        .exclude(pk=operation.pk)
        .exclude(state=OperationState.FAILED)
        .first()
    )
    if newer is not None:
        return (
            f"{operation.entity_type} {operation.entity_id} has another operation ({newer.key}, "
            f"{newer.state}); running this one again could charge twice"
        )
    status = _order_status(operation)
    return None if status is None else f"the order is {status}; it cannot be charged"


def refuse_new_checkout(operation: Operation) -> str | None:
    """Why the order is not open for a new payment attempt, or None."""
    status = _order_status(operation)
    return None if status is None else f"the order is {status}, not open for a new payment attempt"


def new_checkout_attempt(
    operation: Operation, key: str, actor: str, options: dict[str, Any]
) -> tuple[Operation, bool]:
    """Write the next checkout of the order (another card may be given). In the desk's tx."""
    return request_checkout(
        order_id=int(operation.params["order_id"]),
        key=key,
        payment_method=options.get("payment_method") or operation.params["payment_method"],
        actor=actor,
        retry_of=operation,
        scope=KeyScope.DERIVED,
        client=ApiClient.of_tenant(operation.tenant),
    )


def describe_charge(operation: Operation) -> str:
    """One line for the desk: the money at stake."""
    return money_line(operation, "charge")


@operation(
    CHECKOUT,
    steps={CHARGE: OrderCharge, INVOICE: None, CONFIRMATION_EMAIL: None, MARK_PAID: None},
    on_failure=mark_order_failed,
    on_resume=reopen_order,
    entity=Order,
    # The charge comes first on every run: its claim commits with the lease.
    opens_with=CHARGE,
    desk=Desk(
        lock_entity=lock_order,
        describe=describe_charge,
        refuse_rerun=refuse_charging_again,
        new_attempt=new_checkout_attempt,
        refuse_new_attempt=refuse_new_checkout,
    ),
)
def checkout(run: Run) -> None:
    """Charge the order once, invoice it, confirm by e-mail, mark it paid."""
    # Read with the lease: what the steps use of it (amount, currency, e-mail) never changes.
    order: Order = run.entity
    charge = run.external(CHARGE)
    reference = charge["reference"]
    run.local(INVOICE, lambda: issue_invoice(order, reference))
    confirmation = run.side_effect(
        CONFIRMATION_EMAIL,
        lambda: send_confirmation(order, reference),
        policy=DeliveryPolicy.AT_MOST_ONCE,
    )
    run.local(MARK_PAID, lambda: mark_paid(order, reference, run.operation, confirmation))
