"""A worker killed at each fence point of an Adyen charge: redelivered, one payment at Adyen.

Real processes: `manage.py rqworker` (SIGKILLed by the failpoint), `run_recovery` beside
it, the fake Adyen over HTTP. Transactional: the worker processes must see committed rows.
"""

from __future__ import annotations

import json

import pytest

from payments.captures.handler import request_capture
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine.failpoints import (
    AFTER_CLAIM_COMMIT,
    AFTER_PROVIDER_ACCEPT,
    AFTER_RECORD_COMMIT,
    POINTS,
)
from payments.models import ClaimState, Invoice, Operation, OperationState, OrderStatus
from tests.support.adyen import adyen_shop
from tests.support.workers import SIMPLE, Supervisor, wait_until, worker_env

pytestmark = pytest.mark.django_db(transaction=True)

CARD = json.dumps({"type": "scheme", "holderName": "John Smith"})


@pytest.mark.parametrize("point", POINTS)
def test_adyen_crash_at_point__redelivery_charges_once_and_finishes(point, adyen, queue, tmp_path):
    shop = adyen_shop()
    order = create_order(amount=2500, currency="eur", email="crash@example.com", client=shop)
    op, _ = request_checkout(
        order_id=order.pk, key=f"adyen-crash-{point}", payment_method=CARD, actor="t", client=shop
    )
    marker = tmp_path / "failpoint"
    env = worker_env(
        adyen.url,
        FENCE_FAILPOINTS=point,
        FENCE_FAILPOINT_MARKER=str(marker),
        DJANGO_SETTINGS_MODULE="tests.adyen.worker_settings",
        ADYEN_URL=adyen.checkout_url,
    )
    supervisor = Supervisor(env, f"adyen-crash-{point}", SIMPLE)

    def succeeded() -> bool:
        supervisor.poll()
        return Operation.objects.get(pk=op.pk).state == OperationState.SUCCEEDED

    try:
        wait_until(succeeded, timeout=40, what=f"operation to succeed after a crash at {point}")
    finally:
        stderr = supervisor.stop()

    assert marker.with_name(f"failpoint.{point}").exists(), f"no crash happened:\n{stderr}"
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    assert adyen.state.authorised_count() == 1  # one payment at Adyen, whatever the crash
    charge = op.claims.get(step="charge")
    assert charge.state == ClaimState.DONE
    assert adyen.state.payments()[0].psp == charge.provider_reference
    assert Invoice.objects.filter(order=order).count() == 1


@pytest.mark.parametrize("point", [AFTER_CLAIM_COMMIT, AFTER_PROVIDER_ACCEPT, AFTER_RECORD_COMMIT])
def test_adyen_capture_crash_at_point__one_hold_one_capture_and_finishes(
    point, adyen_to_app, queue, tmp_path
):
    """The capture's notifications reach the app's live endpoint; the worker is a process
    of its own, killed at the point the first time any step reaches it."""
    shop = adyen_shop()
    order = create_order(amount=4000, currency="eur", email="crash@example.com", client=shop)
    op, _ = request_capture(
        order_id=order.pk, key=f"adyen-cap-{point}", payment_method=CARD, actor="t", client=shop
    )
    marker = tmp_path / "failpoint"
    env = worker_env(
        adyen_to_app.url,
        FENCE_FAILPOINTS=point,
        FENCE_FAILPOINT_MARKER=str(marker),
        DJANGO_SETTINGS_MODULE="tests.adyen.worker_settings",
        ADYEN_URL=adyen_to_app.checkout_url,
    )
    supervisor = Supervisor(env, f"adyen-cap-{point}", SIMPLE)

    def succeeded() -> bool:
        supervisor.poll()
        return Operation.objects.get(pk=op.pk).state == OperationState.SUCCEEDED

    try:
        wait_until(succeeded, timeout=60, what=f"capture to succeed after a crash at {point}")
    finally:
        stderr = supervisor.stop()

    assert marker.with_name(f"failpoint.{point}").exists(), f"no crash happened:\n{stderr}"
    assert [(e["eventCode"], e["amount"]["value"]) for e in adyen_to_app.state.timeline()] == [
        ("AUTHORISATION", 4000),
        ("CAPTURE", 4000),
    ]
    assert Invoice.objects.filter(order=order).count() == 1
    assert set(op.claims.values_list("step", "state")) == {
        ("authorize", ClaimState.DONE),
        ("capture", ClaimState.DONE),
        ("record", ClaimState.DONE),
    }
