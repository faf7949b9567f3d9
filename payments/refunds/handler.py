"""The `refund` operation: refund at the provider -> credit note and the order's refunded total.

`request_refund` is what the API (and the desk's new attempt) calls: under the
order's lock it checks that the refund fits in what is left of the charge,
counting every refund already asked for and not failed, and writes the
operation in the same transaction; the job is enqueued on commit. The
provider checks the limit again (an over-refund is a 400: the step fails).

A duplicate charge (a second provider success for an order already paid,
which the fence audit reports) is given back by `request_duplicate_refund`:
a refund of that other payment intent, limited by what it charged, which
leaves the order's refunded total alone (the customer paid the order once).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from payments.adyen.choice import payment_system_of
from payments.exceptions import InvalidTransition
from payments.fence import Desk, EffectResult, Run, create_operation_in_tx, operation
from payments.models import ApiClient, KeyScope, Operation, OperationState, tenant_of
from payments.money import format_money
from payments.provider.client import ProviderClient
from payments.provider.errors import ProviderError
from payments.refunds.effect import OrderRefund
from payments.refunds.names import CREDIT_NOTE, REFUND, REFUND_REVERSED, REFUND_STEP
from payments.refunds.rules import not_refundable, refuse_unseen_in_tx
from payments.shop.entities import lock_order, money_line
from payments.shop.models import CreditNote, Invoice, Order, OrderStatus

logger = logging.getLogger("payments.refunds")

#: Orders a refund may be asked for: charged, and not all given back yet.
REFUNDABLE_STATUSES = frozenset({OrderStatus.PAID, OrderStatus.PARTIALLY_REFUNDED})


class RefundNotAllowed(InvalidTransition):
    """The order is not paid, or the amount exceeds what is left to refund."""


def reserved_amount_in_tx(order: Order) -> int:
    """Minor units given back or asked for: refund operations not failed, and not reversed by
    the provider since (a refund that failed after it succeeded gave nothing back). In the tx."""
    return _reserved_in_tx(order, lambda params: not params.get("duplicate"))


def _reserved_in_tx(order: Order, counts: Any) -> int:
    """Sum the amounts of the order's refunds not failed nor reversed whose params `counts`."""
    refunds = (
        Operation.objects.filter(kind=REFUND, entity_type="order", entity_id=str(order.pk))
        .exclude(state=OperationState.FAILED)
        .exclude(claims__step=REFUND_REVERSED)
    )
    return sum(
        int(params.get("amount", 0))
        for params in refunds.values_list("params", flat=True)
        if counts(params)
    )


def charged_amount(order: Order) -> int:
    """What the order's charge took: its invoice's amount (a partial capture invoices less
    than the order's amount), else the order's amount."""
    invoice = Invoice.objects.filter(order=order).only("amount").first()
    return order.amount if invoice is None else invoice.amount


def request_refund(
    *,
    order_id: int,
    key: str,
    amount: int,
    actor: str,
    retry_of: Operation | None = None,
    scope: str = KeyScope.CLIENT,
    client: ApiClient | None = None,
    seen: int | None = None,
) -> tuple[Operation, bool]:
    """Write the refund operation of an order and enqueue it on commit; (operation, created).

    The same key with the same parameters returns the existing operation; with
    other parameters it raises OperationConflict. Raises RefundNotAllowed when
    the order is not paid or `amount` exceeds what is left, counting refunds in
    flight (two refunds racing for the last euro: the order's lock lets one win).
    `seen` is the newest refund of the order the caller was shown (see
    refuse_unseen_in_tx). Raises Order.DoesNotExist for an unknown order.
    """
    with transaction.atomic():
        order = Order.objects.select_for_update().get(pk=order_id)
        invoice = Invoice.objects.filter(order=order).first()
        params = {
            "order_id": order.pk,
            "amount": int(amount),
            "currency": order.currency,
            "payment_intent": invoice.provider_reference if invoice is not None else "",
            # The system the payment went through, whatever the shop pays with today.
            **payment_system_of(invoice.provider_reference if invoice is not None else ""),
        }
        if not Operation.objects.filter(tenant=tenant_of(client), scope=scope, key=key).exists():
            refuse_unseen_in_tx(order, seen)
            if order.status not in REFUNDABLE_STATUSES or invoice is None:
                raise RefundNotAllowed(not_refundable(order))
            left = invoice.amount - reserved_amount_in_tx(order)
            if not 0 < amount <= left:
                raise RefundNotAllowed(
                    f"order {order.pk} has {format_money(left, order.currency)} left to refund,"
                    f" not {format_money(amount, order.currency)}"
                )
        op, created = create_operation_in_tx(
            key=key,
            kind=REFUND,
            entity_type="order",
            entity_id=order.pk,
            params=params,
            actor=actor,
            retry_of=retry_of,
            scope=scope,
            tenant=tenant_of(client),
        )
    return op, created


class DuplicateNotFound(RefundNotAllowed):
    """The payment intent named is not a succeeded duplicate charge of the order."""


def request_duplicate_refund(
    *,
    order_id: int,
    payment_intent: str,
    key: str,
    amount: int,
    actor: str,
    retry_of: Operation | None = None,
    seen: int | None = None,
) -> tuple[Operation, bool]:
    """Give back `amount` of a duplicate charge of an order; (operation, created).

    The provider is asked first, outside any transaction, that `payment_intent`
    succeeded, names the order in its metadata and is not the charge the order
    was invoiced for; then, under the order's lock, that `amount` fits in what
    that intent charged less its refunds in flight. The order's refunded total
    does not move (see issue_credit_note). Raises DuplicateNotFound or
    RefundNotAllowed.
    """
    try:
        with ProviderClient.from_settings() as client:
            intent = client.retrieve_payment_intent(payment_intent)
    except ProviderError as exc:
        raise DuplicateNotFound(f"the provider did not show {payment_intent}: {exc}") from exc
    with transaction.atomic():
        order = Order.objects.select_for_update().get(pk=order_id)
        invoice = Invoice.objects.filter(order=order).first()
        if intent.status != "succeeded" or intent.metadata.get("order_id") != str(order.pk):
            raise DuplicateNotFound(
                f"{payment_intent} is not a succeeded charge of order {order.pk}"
            )
        if invoice is None or invoice.provider_reference == payment_intent:
            raise DuplicateNotFound(f"{payment_intent} is the order's own charge, not a duplicate")
        if intent.currency.lower() != order.currency.lower():
            raise DuplicateNotFound(
                f"{payment_intent} is in {intent.currency}, not {order.currency}"
            )
        charged = intent.amount_received or intent.amount
        left = charged - _reserved_in_tx(order, lambda p: p.get("payment_intent") == payment_intent)
        if not Operation.objects.filter(scope=KeyScope.DERIVED, key=key).exists():
            refuse_unseen_in_tx(order, seen)
            if not 0 < amount <= left:
                raise RefundNotAllowed(
                    f"{payment_intent} has {format_money(left, order.currency)} left to refund,"
                    f" not {format_money(amount, order.currency)}"
                )
        params = {
            "order_id": order.pk,
            "amount": int(amount),
            "currency": order.currency,
            "payment_intent": payment_intent,
            "duplicate": True,
        }
        return create_operation_in_tx(
            key=key,
            kind=REFUND,
            entity_type="order",
            entity_id=order.pk,
            params=params,
            actor=actor,
            retry_of=retry_of,
            scope=KeyScope.DERIVED,
        )


def issue_credit_note(operation: Operation, reference: str) -> dict[str, Any]:
    """Write the refund's credit note and the order's refunded total. Runs in the step's tx.

    A refund the provider reversed before this step ran (it failed after it
    succeeded) gave nothing back: no credit note, the order unchanged.
    """
    order = Order.objects.select_for_update().get(pk=operation.params["order_id"])
    # Read after the order's lock: a reversal committed meanwhile is seen (reverse_refund
    # takes the same lock).
    if operation.claims.filter(step=REFUND_REVERSED).exists():
        return {"credit_note": None, "reversed": True, "order_status": order.status}
    amount = int(operation.params["amount"])
    note = CreditNote.objects.create(
        order=order,
        number=credit_note_number(operation),
        amount=amount,
        currency=order.currency,
        provider_reference=reference,
    )
    if operation.params.get("duplicate"):  # the order was paid once: its totals stay
        return {"credit_note": note.number, "duplicate": True, "order_status": order.status}
    order.refunded_amount += amount
    charged = charged_amount(order)
    order.status = (
        OrderStatus.REFUNDED if order.refunded_amount >= charged else OrderStatus.PARTIALLY_REFUNDED
    )
    order.save(update_fields=["refunded_amount", "status", "updated_at"])
    return {"credit_note": note.number, "order_status": order.status}


def reverse_refund(operation: Operation, found: EffectResult) -> None:
    """Give the order back what a refund that failed after it succeeded did not refund.

    The provider returned the money to the balance (Stripe: the refund's
    `failure_balance_transaction`): the order's refunded total and status go
    back, so the order shows what the provider holds, and the amount may be
    refunded again. Only what the refund wrote is undone: before its credit
    note was written there is nothing to undo (issue_credit_note then writes
    none). The credit note stays as issued; the reversal is in the operation's
    audit trail, with an alert, for a person to settle with the customer.
    Runs in the transaction that records the reversal.
    """
    order = Order.objects.select_for_update().get(pk=operation.params["order_id"])
    if not CreditNote.objects.filter(number=credit_note_number(operation)).exists():
        return  # the refund's later step has not run: it will see the reversal
    if operation.params.get("duplicate"):
        return  # a duplicate's refund never counted in the order's totals
    amount = int(operation.params["amount"])
    if order.refunded_amount < amount:  # the books disagree: stop, let a person look
        raise InvalidTransition(
            f"order {order.pk} shows {order.refunded_amount} refunded, less than the "
            f"reversed {amount}; nothing was changed"
        )
    order.refunded_amount -= amount
    order.status = OrderStatus.PARTIALLY_REFUNDED if order.refunded_amount else OrderStatus.PAID
    order.save(update_fields=["refunded_amount", "status", "updated_at"])
    logger.warning(
        "refund %s of order %s failed at the provider after it succeeded (%s); order reopened",
        operation.key,
        order.pk,
        found.reference,
    )


def credit_note_number(operation: Operation) -> str:
    """The number of a refund operation's credit note."""
    return f"CN-{operation.pk:08d}"


# --- what the operators' desk needs (payments.fence.Desk) -------------


def refund_no_longer_fits(operation: Operation) -> str | None:
    """Why a failed refund may not run again: the order's other refunds took the rest."""
    order = Order.objects.filter(pk=operation.params.get("order_id")).first()
    if order is None:
        return "the order is missing"
    if operation.params.get("duplicate"):
        return None  # request_duplicate_refund checks that intent's own limit again
    left = charged_amount(order) - reserved_amount_in_tx(order)
    if int(operation.params["amount"]) > left:
        return f"only {format_money(left, order.currency)} is left to refund"
    return None


def new_refund_attempt(
    operation: Operation, key: str, actor: str, options: dict[str, Any]
) -> tuple[Operation, bool]:
    """Ask again for the same refund under a new key. In the desk's tx."""
    if operation.params.get("duplicate"):
        return request_duplicate_refund(
            order_id=int(operation.params["order_id"]),
            payment_intent=str(operation.params["payment_intent"]),
            key=key,
            amount=int(operation.params["amount"]),
            actor=actor,
            retry_of=operation,
        )
    return request_refund(
        order_id=int(operation.params["order_id"]),
        key=key,
        amount=int(operation.params["amount"]),
        actor=actor,
        retry_of=operation,
        scope=KeyScope.DERIVED,
        client=ApiClient.of_tenant(operation.tenant),
    )


def refund_from_desk(
    order_id: int, key: str, amount: int, actor: str, options: dict[str, Any]
) -> tuple[Operation, bool]:
    """Refund an order from the desk: its charge, or the duplicate `options["charge"]` names.

    `options["seen"]`: the newest refund of the order the operator was shown (absent: not
    checked).
    """
    duplicate = str(options.get("charge") or "")
    seen = None if options.get("seen") is None else int(options["seen"])
    if duplicate:
        return request_duplicate_refund(
            order_id=order_id,
            payment_intent=duplicate,
            key=key,
            amount=amount,
            actor=actor,
            seen=seen,
        )
    return request_refund(
        order_id=order_id, key=key, amount=amount, actor=actor, scope=KeyScope.DERIVED, seen=seen
    )


def refund_left(order_id: int) -> int:
    """What is left to refund of the order's charge, refunds in flight counted."""
    order = Order.objects.get(pk=order_id)
    return max(charged_amount(order) - reserved_amount_in_tx(order), 0)


def refuse_order_refund(order_id: int) -> str | None:
    """Why the order's charge cannot be refunded now (not paid, nothing left), or None."""
    order = Order.objects.get(pk=order_id)
    if order.status not in REFUNDABLE_STATUSES or not Invoice.objects.filter(order=order).exists():
        return not_refundable(order)
    if refund_left(order_id) <= 0:
        return f"order {order.pk}: nothing is left to refund (refunds in flight counted)"
    return None


def describe_refund(operation: Operation) -> str:
    """One line for the desk: the money at stake."""
    return money_line(operation, "refund")


@operation(
    REFUND,
    entity=Order,
    steps={REFUND_STEP: OrderRefund, CREDIT_NOTE: None},
    on_reversal=reverse_refund,
    desk=Desk(
        lock_entity=lock_order,
        describe=describe_refund,
        refuse_rerun=refund_no_longer_fits,
        new_attempt=new_refund_attempt,
        refund=refund_from_desk,
        refund_left=refund_left,
        refuse_refund=refuse_order_refund,
    ),
)
def refund(run: Run) -> None:
    """Refund the amount once at the provider, then write the credit note."""
    result = run.external(REFUND_STEP)
    run.local(CREDIT_NOTE, lambda: issue_credit_note(run.operation, result["reference"]))
