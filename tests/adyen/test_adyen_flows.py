"""Checkout, capture and refund through Adyen: real PostgreSQL, Redis, worker and fake Adyen.

Transactional: the fence commits its claim before each call to Adyen, and a
notification settles a claim in a transaction of its own: commit visibility is what
these tests are about.
"""

from __future__ import annotations

import json
import threading

import pytest
from django.db import connection

from devtools.fake_provider.adyen.notifications import sign
from payments.adyen.models import Notification
from payments.captures.handler import request_capture
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine.failpoints import AFTER_PROVIDER_ACCEPT, hooked, point_at
from payments.engine.handlers import money_moved
from payments.engine.recovery import reconcile
from payments.models import ApiClient, ClaimState, Operation, OperationState
from payments.refunds.handler import request_refund
from payments.shop.models import CreditNote, Invoice, Order, OrderStatus
from tests.support.adyen import HMAC_KEY, adyen_shop, deliver, item
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

DECLINED = json.dumps({"type": "scheme", "holderName": "DECLINED"})
CARD = json.dumps({"type": "scheme", "holderName": "John Smith"})


def adyen_checkout(shop: ApiClient, *, amount: int = 2500, pm: str = CARD) -> Operation:
    order = create_order(amount=amount, currency="eur", email="buyer@example.com", client=shop)
    op, _ = request_checkout(
        order_id=order.pk, key=f"adyen-{order.pk}", payment_method=pm, actor="test", client=shop
    )
    return op


def paid_through_adyen(adyen, queue, shop: ApiClient) -> Operation:
    op = adyen_checkout(shop)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    return op


def test_checkout__adyen_shop__authorised_once_invoiced_and_paid(adyen, queue):
    op = adyen_checkout(adyen_shop())

    run_worker(queue)

    op.refresh_from_db()
    order = Order.objects.get(pk=op.params["order_id"])
    assert (op.state, order.status) == (OperationState.SUCCEEDED, OrderStatus.PAID)
    assert op.params["system"] == "adyen"
    charge = op.claims.get(step="charge")
    assert charge.state == ClaimState.DONE
    assert len(charge.provider_reference) == 16 and charge.provider_reference.isalnum()
    assert charge.idempotency_key.startswith("fence_")
    assert charge.request["reference"] == f"fence:{op.pk}:charge"
    assert adyen.state.authorised_count() == 1
    assert Invoice.objects.get(order=order).provider_reference == charge.provider_reference
    assert money_moved(op) == (2500, "eur")


def test_checkout__stripe_shop__still_pays_through_the_provider(provider, adyen, queue):
    """The default system is unchanged: no "system" in params, nothing sent to Adyen."""
    shop = ApiClient.objects.create(name="stripe-shop")
    order = create_order(amount=1000, currency="eur", email="b@example.com", client=shop)
    op, _ = request_checkout(
        order_id=order.pk, key="stripe-1", payment_method="pm_card_visa", actor="t", client=shop
    )

    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED and "system" not in op.params
    assert op.claims.get(step="charge").provider_reference.startswith("pi_")
    assert adyen.state.stats()["payments"] == 0


def test_checkout__refused_by_adyen__fails_at_once_without_retry(adyen, queue):
    op = adyen_checkout(adyen_shop(), pm=DECLINED)

    run_worker(queue)

    op.refresh_from_db()
    assert (op.state, op.attempts) == (OperationState.FAILED, 0)
    assert Order.objects.get(pk=op.params["order_id"]).status == OrderStatus.PAYMENT_FAILED
    claim = op.claims.get(step="charge")
    assert claim.state == ClaimState.FAILED
    assert claim.result["code"] == "2" and claim.result["status"] == "Refused"
    assert adyen.state.authorised_count() == 0


def test_capture__held_then_captured__done_only_when_the_capture_notification_says(
    adyen, queue, notes
):
    shop = adyen_shop()
    order = create_order(amount=5000, currency="eur", email="c@example.com", client=shop)
    op, _ = request_capture(
        order_id=order.pk,
        key="cap-1",
        payment_method=CARD,
        amount_to_capture=3000,
        actor="test",
        client=shop,
    )

    run_worker(queue)

    # Adyen received the capture (201); its outcome is not known yet: the step is pending.
    op.refresh_from_db()
    capture = op.claims.get(step="capture")
    assert op.state == OperationState.UNCERTAIN
    assert capture.state == ClaimState.UNCERTAIN and len(capture.provider_reference) == 16
    assert not Invoice.objects.filter(order=order).exists()

    (body,) = notes.wait_for("CAPTURE")
    assert deliver(body) == (200, "[accepted]")
    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert (op.state, order.status) == (OperationState.SUCCEEDED, OrderStatus.PAID)
    capture.refresh_from_db()
    assert capture.state == ClaimState.DONE
    authorisation = op.claims.get(step="authorize").provider_reference
    assert capture.result["payment_intent"] == authorisation
    invoice = Invoice.objects.get(order=order)
    assert (invoice.amount, invoice.provider_reference) == (3000, authorisation)
    assert [(e["eventCode"], e["amount"]["value"]) for e in adyen.state.timeline()] == [
        ("AUTHORISATION", 5000),
        ("CAPTURE", 3000),
    ]


def test_capture__notification_while_the_worker_holds_the_claim__the_reconciler_reads_it(
    adyen, queue, notes
):
    """The CAPTURE notification came while the claim was busy: it is kept, and the
    reconciler's look (Adyen has no lookup: the stored notification) settles the step."""
    shop = adyen_shop()
    order = create_order(amount=4000, currency="eur", email="c@example.com", client=shop)
    op, _ = request_capture(
        order_id=order.pk, key="cap-2", payment_method=CARD, actor="test", client=shop
    )
    run_worker(queue)
    capture = op.claims.get(step="capture")
    (body,) = notes.wait_for("CAPTURE")
    Notification.objects.create(  # as the endpoint stores one it cannot apply yet
        psp_reference=item(body)["pspReference"],
        original_reference=item(body)["originalReference"],
        merchant_account=item(body)["merchantAccountCode"],
        merchant_reference=item(body)["merchantReference"],
        event_code="CAPTURE",
        success=True,
        amount=4000,
        currency="EUR",
        outcome="busy",
    )

    report = reconcile()

    assert report.count("done") == 1, report.outcomes
    capture.refresh_from_db()
    assert capture.state == ClaimState.DONE
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED


def test_refund__received_then_settled_by_its_notification__credit_note_once(adyen, queue, notes):
    shop = adyen_shop()
    paid = paid_through_adyen(adyen, queue, shop)
    order = Order.objects.get(pk=paid.params["order_id"])
    refund, _ = request_refund(order_id=order.pk, key="ref-1", amount=1000, actor="t", client=shop)
    assert refund.params["system"] == "adyen"

    run_worker(queue)

    refund.refresh_from_db()
    assert refund.state == OperationState.UNCERTAIN
    assert not CreditNote.objects.filter(order=order).exists()
    (body,) = notes.wait_for("REFUND")
    assert item(body)["originalReference"] == paid.claims.get(step="charge").provider_reference
    assert deliver(body) == (200, "[accepted]")
    run_worker(queue)

    refund.refresh_from_db()
    order.refresh_from_db()
    assert refund.state == OperationState.SUCCEEDED
    assert (order.status, order.refunded_amount) == (OrderStatus.PARTIALLY_REFUNDED, 1000)
    assert CreditNote.objects.filter(order=order).count() == 1
    assert [e["eventCode"] for e in adyen.state.timeline()] == ["AUTHORISATION", "REFUND"]


def test_refund__refused_in_its_notification__the_step_fails_and_nothing_is_credited(
    adyen, queue, notes
):
    shop = adyen_shop()
    paid = paid_through_adyen(adyen, queue, shop)
    order = Order.objects.get(pk=paid.params["order_id"])
    refund, _ = request_refund(order_id=order.pk, key="ref-2", amount=2500, actor="t", client=shop)
    run_worker(queue)
    (body,) = notes.wait_for("REFUND")
    refused = json.loads(json.dumps(body))
    refused_item = item(refused)
    # A REFUND failed notification, signed as Adyen signs it.
    refused_item["success"] = "false"
    refused_item["reason"] = "Insufficient balance"
    refused_item["additionalData"]["hmacSignature"] = sign(refused_item, HMAC_KEY)

    assert deliver(refused) == (200, "[accepted]")

    refund.refresh_from_db()
    assert refund.state == OperationState.FAILED
    claim = refund.claims.get(step="refund")
    assert claim.state == ClaimState.FAILED and "Insufficient balance" in claim.error
    assert not CreditNote.objects.filter(order=order).exists()


def test_notification_while_the_worker_holds_the_claim__kept_busy__the_workers_answer_settles(
    adyen, queue, notes
):
    """Adyen's AUTHORISATION comes between its answer and the worker's record (another
    connection, as the web process): the claim is the worker's, so the notification is
    stored and changes nothing; the worker records its own answer, once."""
    op = adyen_checkout(adyen_shop())
    answers: list[tuple[int, str]] = []

    def deliver_from_the_web() -> None:
        (body,) = notes.wait_for("AUTHORISATION")

        def web() -> None:
            try:
                answers.append(deliver(body))
            finally:
                connection.close()

        thread = threading.Thread(target=web)
        thread.start()
        thread.join(timeout=10)

    with hooked(point_at(AFTER_PROVIDER_ACCEPT, "charge"), deliver_from_the_web):
        run_worker(queue)

    assert answers == [(200, "[accepted]")]
    assert Notification.objects.get().outcome == "busy"
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    charge = op.claims.get(step="charge")
    assert charge.provider_reference == Notification.objects.get().psp_reference
    assert adyen.state.authorised_count() == 1


def test_checkout__adyen_shop_without_settings_entry__needs_review_and_nothing_sent(
    adyen, queue, settings
):
    settings.PAYMENTS = {**settings.PAYMENTS, "SYSTEMS": {}}
    op = adyen_checkout(adyen_shop())

    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW
    assert 'PAYMENTS["SYSTEMS"]["adyen"]' in op.last_error
    assert not op.claims.exists()  # the effect is built before any claim: nothing was sent
    assert adyen.state.stats()["payments"] == 0
