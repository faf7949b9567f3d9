"""The fake Adyen delivering its signed notifications over HTTP to the app's own endpoint,
and the desk showing what an Adyen step waits for.

Transactional: the live server answers from its own thread and connection, and the
worker must see what it committed.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.urls import reverse

from payments.adyen.models import Notification
from payments.captures.handler import request_capture
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine.recovery import reconcile
from payments.models import ClaimState, OperationState
from payments.shop.models import Invoice, Order, OrderStatus
from tests.support.adyen import adyen_shop, deliver
from tests.support.builders import backdate
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

CARD = json.dumps({"type": "scheme", "holderName": "John Smith"})


def test_capture__the_fakes_capture_notification_reaches_the_endpoint_and_settles_it(
    adyen_to_app, queue
):
    shop = adyen_shop()
    order = create_order(amount=6000, currency="eur", email="live@example.com", client=shop)
    op, _ = request_capture(
        order_id=order.pk, key="live-cap", payment_method=CARD, actor="t", client=shop
    )

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        run_worker(queue)
        reconcile()  # what run_recovery does: a notification stored while the claim was busy
        op.refresh_from_db()
        if op.state == OperationState.SUCCEEDED:
            break
        time.sleep(0.1)

    assert op.state == OperationState.SUCCEEDED
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    assert Invoice.objects.get(order=order).amount == 6000
    assert set(Notification.objects.values_list("event_code", flat=True)) == {
        "AUTHORISATION",
        "CAPTURE",
    }
    sent = adyen_to_app.notifications.stats()
    assert sent["accepted"] == 2, sent  # the endpoint's "[accepted]" stopped Adyen's retries


def test_desk__an_adyen_charge_past_its_deadline__shows_its_review(adyen, queue, admin_client):
    """Its notification never reaches the app (`adyen` catches them): review, not a guess."""
    shop = adyen_shop()
    order = create_order(amount=2500, currency="eur", email="desk@example.com", client=shop)
    op, _ = request_checkout(
        order_id=order.pk, key="desk-lost", payment_method=CARD, actor="t", client=shop
    )
    adyen.state.enqueue_faults("drop_after_accept")
    run_worker(queue)
    claim = op.claims.get(step="charge")
    backdate(claim, timedelta(days=8))
    reconcile()

    page = admin_client.get(reverse("admin:payments_operation_change", args=[op.pk]))

    op.refresh_from_db()
    claim.refresh_from_db()
    assert (op.state, claim.state) == (OperationState.NEEDS_REVIEW, ClaimState.UNCERTAIN)
    assert page.status_code == 200
    assert b"replay window ended at" in page.content
    assert Order.objects.get(pk=order.pk).status == OrderStatus.PROCESSING


def test_desk__notifications_listed_read_only(adyen, queue, notes, admin_client):
    op = adyen_checkout_paid(adyen, queue)
    (body,) = notes.wait_for("AUTHORISATION")
    deliver(body)

    listing = admin_client.get(reverse("admin:adyen_notification_changelist"))
    row = Notification.objects.get()
    change = admin_client.post(reverse("admin:adyen_notification_change", args=[row.pk]), {})

    assert listing.status_code == 200
    assert row.psp_reference.encode() in listing.content
    assert row.psp_reference == op.claims.get(step="charge").provider_reference
    assert change.status_code == 403  # read-only, even for a superuser
    assert admin_client.get(reverse("admin:adyen_notification_add")).status_code == 403


def adyen_checkout_paid(adyen, queue):
    shop = adyen_shop()
    order = create_order(amount=1500, currency="eur", email="n@example.com", client=shop)
    op, _ = request_checkout(
        order_id=order.pk, key="n-1", payment_method=CARD, actor="t", client=shop
    )
    run_worker(queue)
    return op
