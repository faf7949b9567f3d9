"""A worker SIGKILLed just after the provider's 200 for each of the capture's external steps;
the redelivered job holds once and captures once.

Real worker processes (tests.support.workers.Supervisor) against the fake provider.
"""

from __future__ import annotations

import pytest

from payments.captures.handler import request_capture
from payments.checkout.orders import create_order
from payments.models import ClaimState, Operation, OperationState
from payments.shop.models import Invoice, OrderStatus
from tests.support.workers import SIMPLE, Supervisor, worker_env

# Transactional: the worker processes must see the committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("step", ["authorize", "capture"])
def test_crash_after_the_providers_200__redelivery_holds_once_and_captures_once(
    step, provider, queue, tmp_path
):
    order = create_order(amount=4000, currency="eur", email="crash@example.com")
    op, _ = request_capture(
        order_id=order.pk,
        key=f"crash-{step}",
        payment_method="pm_card_visa",
        amount_to_capture=2500,
        actor="test",
    )
    point = f"after_provider_accept@{step}"
    marker = tmp_path / "failpoint"
    env = worker_env(provider.url, FENCE_FAILPOINTS=point, FENCE_FAILPOINT_MARKER=str(marker))
    supervisor = Supervisor(env, f"capture-crash-{step}", SIMPLE)

    def succeeded() -> bool:
        return Operation.objects.get(pk=op.pk).state == OperationState.SUCCEEDED

    stderr = supervisor.run_until(
        succeeded, timeout=40, what=f"capture to succeed after a crash at {point}"
    )

    assert marker.with_name(f"failpoint.{point}").exists(), f"no crash happened:\n{stderr}"
    (intent,) = provider.state.intents(metadata={"operation_key": op.key})
    assert (intent["status"], intent["amount_received"]) == ("succeeded", 2500)
    # One intent for the operation (the authorisation was not made twice), captured once.
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    assert Invoice.objects.get(order=order).amount == 2500
    assert set(op.claims.values_list("step", "state")) == {
        ("authorize", ClaimState.DONE),
        ("capture", ClaimState.DONE),
        ("record", ClaimState.DONE),
    }
