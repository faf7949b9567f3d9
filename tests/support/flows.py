"""Orders and checkouts, and operations brought into shape by the real runtime.

`paid_order`, `failed_by_invoice_bug`, `uncertain_after_read_timeout`,
`declined_charge_held_in_flight` and `refund_failed_by_an_outage` run a worker in this process over real HTTP: for transactional tests only (a claim must commit
before its call). The others only create rows and enqueue on commit.
"""

from __future__ import annotations

import pytest

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine.recovery import reconcile
from payments.models import Operation, OperationState
from payments.refunds.handler import request_refund
from payments.shop.models import Invoice, LedgerEntry, Order, OrderStatus
from tests.support.workers import run_worker


def checkout(key: str = "chk-1", pm: str = "pm_card_visa") -> Operation:
    order = create_order(amount=2500, currency="eur", email="buyer@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method=pm, actor="api")
    return op


def order_and_checkout(
    *, email: str = "buyer@example.com", pm: str = "pm_card_visa", key: str | None = None
) -> tuple[Order, Operation]:
    """Create an order and ask for its checkout (the job is enqueued on commit)."""
    order = create_order(amount=1999, currency="eur", email=email)
    op, _ = request_checkout(
        order_id=order.pk, key=key or f"obs-{order.pk}", payment_method=pm, actor="test"
    )
    return order, op


def paid_order(queue, *, amount: int = 2000, key: str | None = None) -> Order:
    """An order charged by its checkout in a worker of this process (transactional tests)."""
    order = create_order(amount=amount, currency="eur", email="buyer@example.com")
    request_checkout(
        order_id=order.pk, key=key or f"pay-{order.pk}", payment_method="pm_card_visa", actor="t"
    )
    run_worker(queue)
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    return order


def assert_paid_once(provider, orders: dict[str, int]) -> None:
    """Each order (by its checkout's key) paid by one provider success, with one invoice and
    one ledger line."""
    for key, order_id in orders.items():
        assert Order.objects.get(pk=order_id).status == OrderStatus.PAID, key
        assert provider.state.succeeded_count(metadata={"operation_key": key}) == 1, key
        assert provider.state.succeeded_count(metadata={"order_id": str(order_id)}) == 1, key
        assert Invoice.objects.filter(order_id=order_id).count() == 1, key
        assert LedgerEntry.objects.filter(order_id=order_id).count() == 1, key


def failed_by_invoice_bug(monkeypatch: pytest.MonkeyPatch, queue, key: str = "chk-1") -> Operation:
    """Charged once, then a bug in the invoice step used up every attempt.

    The money is taken, so the operation is parked in needs_review (never
    failed: that would tell the customer the payment failed), and the job is
    in the failed registry.
    """

    def broken_invoice(order_id: int, reference: str) -> dict:
        raise RuntimeError("invoice numbering bug")

    with monkeypatch.context() as patch:
        patch.setattr("payments.checkout.handler.issue_invoice", broken_invoice)
        op = checkout(key)
        run_worker(queue)
    op.refresh_from_db()
    return op


def uncertain_after_read_timeout(provider, queue, key: str = "chk-1") -> Operation:
    """The provider charged but its answer came after our read timeout: uncertain."""
    provider.state.configure(slow_delay=1.5)  # longer than the 1 s read timeout
    provider.state.enqueue_faults("slow", 1)
    op = checkout(key)
    run_worker(queue)
    assert provider.state.wait_idle(timeout=5)  # the charge is stored at the provider
    op.refresh_from_db()
    return op


def declined_charge_held_in_flight(
    provider, queue, key: str, *, amount: int = 7450, slow: float = 4.0
) -> Operation:
    """A declined charge whose answer the provider holds past the read timeout, then looked
    at once by the reconciler: every same-key replay answers 409 (in flight) while the
    provider's list shows the declined intent. Wait for the provider (`wait_idle`) after."""
    provider.state.configure(slow_delay=slow)
    provider.state.enqueue_faults("slow", 1)
    order = create_order(amount=amount, currency="eur", email="held@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key=key, payment_method="pm_card_chargeDeclined", actor="t"
    )
    run_worker(queue)
    reconcile(operation_ids=[op.pk])  # 409 in flight; the list shows the declined intent
    return op


def refund_failed_by_an_outage(provider, queue, key: str) -> Operation:
    """A paid order's refund whose every try the provider refused before it executed (an
    outage): the fence gave up, the refund failed, nothing ran, the customer is still owed."""
    order = paid_order(queue)
    provider.state.enqueue_faults("fail_before", 3)
    op, _ = request_refund(order_id=order.pk, key=key, amount=400, actor="api")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    return op


def charged_twice(queue, key: str = "twice-1") -> tuple[Order, str, str]:
    """An order charged twice at the provider: (order, fenced reference, duplicate reference).

    Its checkout runs in a real worker; the second charge is a real payment
    intent at the fake provider naming the order in its metadata (a call made
    outside the fence, as a script or a second system would), and the fence
    audit then reports the order charged twice. Transactional tests only.
    """
    import io

    from django.core.management import call_command
    from django.core.management.base import CommandError

    from payments.provider.client import ProviderClient

    order, op = order_and_checkout(key=key)
    run_worker(queue)
    fenced = op.claims.get(step="charge").provider_reference
    with ProviderClient.from_settings() as client:
        intent = client.create_payment_intent(
            amount=order.amount,
            currency=order.currency,
            payment_method="pm_card_visa",
            metadata={"order_id": str(order.pk), "operation_key": f"{key}-elsewhere"},
            idempotency_key=f"{key}-outside-the-fence",
        )
    assert intent.status == "succeeded"
    try:
        call_command("fence_audit", stdout=io.StringIO())
    except CommandError:
        pass  # exit 1: it found the double charge, as meant
    return Order.objects.get(pk=order.pk), fenced, intent.id
