"""A worker is SIGKILLed at each named point of the protocol; redelivery charges (refunds) once.

Real `rqworker` processes run against the test database, the test Redis and
the fake provider over HTTP, next to the recovery loop, with a supervisor that
restarts a dead worker. The crash is a failpoint that SIGKILLs the process
running the job at that exact point, once: the work horse of a forking
Worker, or the whole FenceWorker (SimpleWorker, the default).
"""

from __future__ import annotations

import pytest

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine.failpoints import POINTS
from payments.models import ClaimState, Operation, OperationState
from payments.refunds.handler import request_refund
from payments.shop.models import CreditNote, Invoice, OrderStatus
from tests.support.workers import (
    FORKING,
    SIMPLE,
    Supervisor,
    run_worker,
    worker_env,
)

# Transactional: the worker processes must see the committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("worker_class", [SIMPLE, FORKING], ids=["FenceWorker", "Worker"])
@pytest.mark.parametrize("point", POINTS)
def test_crash_at_point__redelivery_charges_once_and_finishes(
    point, worker_class, provider, queue, tmp_path
):
    order = create_order(amount=2500, currency="eur", email="crash@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key=f"crash-{point}", payment_method="pm_card_visa", actor="test"
    )
    marker = tmp_path / "failpoint"
    env = worker_env(provider.url, FENCE_FAILPOINTS=point, FENCE_FAILPOINT_MARKER=str(marker))
    supervisor = Supervisor(env, f"crash-{point}", worker_class)

    def succeeded() -> bool:
        return Operation.objects.get(pk=op.pk).state == OperationState.SUCCEEDED

    stderr = supervisor.run_until(
        succeeded, timeout=40, what=f"operation to succeed after a crash at {point}"
    )

    assert marker.with_name(f"failpoint.{point}").exists(), f"no crash happened:\n{stderr}"
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    assert provider.state.succeeded_count(metadata={"operation_key": op.key}) == 1
    assert Invoice.objects.filter(order=order).count() == 1
    assert set(op.claims.values_list("step", "state")) == {
        ("charge", ClaimState.DONE),
        ("invoice", ClaimState.DONE),
        ("confirmation_email", ClaimState.DONE),
        ("mark_paid", ClaimState.DONE),
    }


@pytest.mark.parametrize("worker_class", [SIMPLE, FORKING], ids=["FenceWorker", "Worker"])
@pytest.mark.parametrize("point", POINTS)
def test_refund_crash_at_point__redelivery_refunds_once_and_finishes(
    point, worker_class, provider, queue, tmp_path
):
    order = create_order(amount=2500, currency="eur", email="crash@example.com")
    request_checkout(
        order_id=order.pk, key=f"paid-{point}", payment_method="pm_card_visa", actor="test"
    )
    run_worker(queue)  # paid, in this process, before any failpoint is armed
    op, _ = request_refund(order_id=order.pk, key=f"refund-{point}", amount=1000, actor="test")
    marker = tmp_path / "failpoint"
    env = worker_env(provider.url, FENCE_FAILPOINTS=point, FENCE_FAILPOINT_MARKER=str(marker))
    supervisor = Supervisor(env, f"refund-crash-{point}", worker_class)

    def succeeded() -> bool:
        return Operation.objects.get(pk=op.pk).state == OperationState.SUCCEEDED

    stderr = supervisor.run_until(
        succeeded, timeout=40, what=f"refund to succeed after a crash at {point}"
    )

    assert marker.with_name(f"failpoint.{point}").exists(), f"no crash happened:\n{stderr}"
    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.PARTIALLY_REFUNDED, 1000)
    assert len(provider.state.refunds(metadata={"operation_key": op.key})) == 1
    assert CreditNote.objects.filter(order=order).count() == 1
    assert set(op.claims.values_list("step", "state")) == {
        ("refund", ClaimState.DONE),
        ("credit_note", ClaimState.DONE),
    }
