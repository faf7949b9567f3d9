"""A worker is SIGKILLed at each named point of the protocol; redelivery charges once.

Real `rqworker` processes (forking workers, with the scheduler) run against
the test database, the test Redis and the fake provider over HTTP. The crash
is a failpoint that SIGKILLs the work horse at that exact point, once.
"""

from __future__ import annotations

import pytest

from payments.checkout import request_checkout
from payments.failpoints import POINTS
from payments.models import ClaimState, Invoice, Operation, OperationState, OrderStatus
from payments.orders import create_order
from tests.support.workers import start_worker, stop_worker, wait_until, worker_env

# Transactional: the worker processes must see the committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("point", POINTS)
def test_crash_at_point__redelivery_charges_once_and_finishes(point, provider, queue, tmp_path):
    order = create_order(amount=2500, currency="eur", email="crash@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key=f"crash-{point}", payment_method="pm_card_visa", actor="test"
    )
    marker = tmp_path / "failpoint"
    env = worker_env(provider.url, FENCE_FAILPOINTS=point, FENCE_FAILPOINT_MARKER=str(marker))
    worker = start_worker(env, name=f"crash-{point}")
    try:
        wait_until(
            lambda: Operation.objects.get(pk=op.pk).state == OperationState.SUCCEEDED,
            timeout=40,
            what=f"operation to succeed after a crash at {point}",
        )
    finally:
        stderr = stop_worker(worker)

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
