"""Adyen's lost answers: no lookup, so a same-key replay within retention, the signed
notification, or review with the evidence and the deadline it missed.

Transactional: the claim commits before the call, and what settles it later (the
reconciler, a notification) commits in transactions of its own.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta

import pytest

from devtools.fake_provider.adyen.notifications import sign
from payments.adyen.models import Notification
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.desk import services as desk
from payments.desk.evidence import next_step
from payments.desk.rules import DeskError
from payments.engine.dispatch import dispatch
from payments.engine.recovery import reconcile
from payments.engine.steps import replay_allowed, replay_deadline
from payments.models import (
    ClaimLook,
    ClaimState,
    LookShowed,
    Operation,
    OperationEvent,
    OperationState,
    StepClaim,
)
from payments.refunds.handler import request_refund
from payments.shop.models import Order, OrderStatus
from tests.support.adyen import HMAC_KEY, MERCHANT, adyen_shop, deliver, item, settings_entry
from tests.support.builders import backdate
from tests.support.users import RECONCILE, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

CARD = json.dumps({"type": "scheme", "holderName": "John Smith"})
DECLINED = json.dumps({"type": "scheme", "holderName": "DECLINED"})


def lost_charge(adyen, queue, pm: str = CARD) -> tuple[Operation, StepClaim]:
    """A checkout whose answer Adyen executed and the network dropped: uncertain."""
    shop = adyen_shop()
    order = create_order(amount=2500, currency="eur", email="lost@example.com", client=shop)
    op, _ = request_checkout(
        order_id=order.pk, key=f"lost-{order.pk}", payment_method=pm, actor="test", client=shop
    )
    adyen.state.enqueue_faults("drop_after_accept")
    run_worker(queue)
    op.refresh_from_db()
    claim = op.claims.get(step="charge")
    assert (op.state, claim.state) == (OperationState.UNCERTAIN, ClaimState.UNCERTAIN)
    assert claim.provider_reference == ""  # the answer, and its pspReference, were lost
    return op, claim


def test_answer_dropped_after_adyen_charged__the_redelivered_job_charges_once(adyen, queue):
    op, claim = lost_charge(adyen, queue)

    dispatch(op.pk)  # RQ hands the operation back
    run_worker(queue)
    reconcile()  # the reconciler's round, as run_recovery runs it
    run_worker(queue)

    op.refresh_from_db()
    claim.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert claim.state == ClaimState.DONE and len(claim.provider_reference) == 16
    assert adyen.state.authorised_count() == 1
    assert adyen.state.stats()["replays"] == 1  # settled by the same key, replayed
    assert Order.objects.get(pk=op.params["order_id"]).status == OrderStatus.PAID


def test_lost_answer_without_notification__stays_uncertain__replayed_within_retention(
    adyen, queue, settings
):
    op, claim = lost_charge(adyen, queue)
    assert replay_deadline(claim) == claim.claimed_at + timedelta(days=7, hours=-1)
    reachable = settings.PAYMENTS
    unreachable = settings_entry("http://127.0.0.1:9/v72")  # nothing listens: not sent
    settings.PAYMENTS = {**reachable, "SYSTEMS": {"adyen": unreachable}}

    first = reconcile()

    op.refresh_from_db()
    claim.refresh_from_db()
    assert (op.state, claim.state) == (OperationState.UNCERTAIN, ClaimState.UNCERTAIN), first
    assert adyen.state.authorised_count() == 1

    settings.PAYMENTS = reachable
    backdate(claim, timedelta(days=6))  # six days on: Adyen still keeps the key
    assert replay_allowed(claim)
    second = reconcile(operation_ids=[op.pk])  # named: looked at now, whatever its next look

    claim.refresh_from_db()
    assert claim.state == ClaimState.DONE, second.outcomes
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert adyen.state.authorised_count() == 1 and adyen.state.stats()["replays"] == 1
    assert not op.events.filter(to_state=OperationState.FAILED).exists()


def test_lost_answer_past_the_deadline__never_replayed__review_with_its_evidence(adyen, queue):
    op, claim = lost_charge(adyen, queue)
    backdate(claim, timedelta(days=7))  # past 7 days less the margin: Adyen may forget the key
    requests_before = adyen.state.stats()["requests"]

    reconcile()

    assert adyen.state.stats()["requests"] == requests_before  # no replay was sent
    op.refresh_from_db()
    claim.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW
    assert claim.state == ClaimState.UNCERTAIN  # never failed: the money may have been taken
    look = ClaimLook.objects.get(claim=claim)
    deadline = replay_deadline(claim).isoformat(timespec="seconds")
    assert look.showed == LookShowed.NO_READ and look.looks >= 1
    assert f"Adyen offers no look-up and its replay window ended at {deadline}" in look.hold
    assert next_step(op, claim, look).startswith("Held for a person: Adyen offers no look-up")
    assert not replay_allowed(claim)
    assert deadline in op.last_error


def held_past_deadline(adyen, queue) -> tuple[Operation, StepClaim]:
    op, claim = lost_charge(adyen, queue)
    backdate(claim, timedelta(days=7))
    reconcile()
    op.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW
    return op, claim


def test_held_charge__marked_succeeded_from_adyens_report__done_and_the_order_paid(adyen, queue):
    """Adyen offers no look-up and no notification came: the operator's reading of Adyen's
    report is the evidence (the dead end was: "no signed notification says it succeeded")."""
    op, claim = held_past_deadline(adyen, queue)
    psp = adyen.state.payments()[0].psp
    rita = make_user("rita", RECONCILE)

    desk.mark_step_succeeded(op, "charge", reference=psp, user=rita, reason="Adyen report, 5 Dec")
    run_worker(queue)

    claim.refresh_from_db()
    op.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, psp)
    assert claim.result["evidence"] == "the operator's reading of Adyen's report"
    assert op.state == OperationState.SUCCEEDED
    assert Order.objects.get(pk=op.params["order_id"]).status == OrderStatus.PAID
    assert adyen.state.authorised_count() == 1  # marking it succeeded moved no money


def test_held_charge__a_reference_that_is_no_psp__or_that_a_notification_contradicts__refused(
    adyen, queue
):
    op, claim = held_past_deadline(adyen, queue)
    rita = make_user("rita", RECONCILE)
    with pytest.raises(DeskError, match="not an Adyen pspReference"):
        desk.mark_step_succeeded(op, "charge", reference="pi_123", user=rita, reason="typo")
    Notification.objects.create(  # a refusal Adyen signed, stored as the endpoint stores one
        psp_reference="REFUSED000000001",
        original_reference="",
        merchant_account=MERCHANT,
        merchant_reference=claim.request["reference"],
        event_code="AUTHORISATION",
        success=False,
        amount=2500,
        currency="EUR",
        outcome="busy",
    )

    with pytest.raises(DeskError, match="no signed AUTHORISATION notification says"):
        desk.mark_step_succeeded(
            op, "charge", reference="ABCDEFGHIJKLMNOP", user=rita, reason="wrong line"
        )
    claim.refresh_from_db()
    assert claim.state == ClaimState.UNCERTAIN


def test_notification__settles_an_uncertain_charge_without_a_replay(adyen, queue, notes):
    op, claim = lost_charge(adyen, queue)
    (body,) = notes.wait_for("AUTHORISATION")

    assert deliver(body) == (200, "[accepted]")

    claim.refresh_from_db()
    assert claim.state == ClaimState.DONE
    assert claim.provider_reference == item(body)["pspReference"]
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert adyen.state.stats()["replays"] == 0 and adyen.state.authorised_count() == 1
    assert Notification.objects.get().outcome == "done"


def test_notification__a_refusal_fails_an_uncertain_charge(adyen, queue, notes):
    op, claim = lost_charge(adyen, queue, pm=DECLINED)
    (body,) = notes.wait_for("AUTHORISATION")

    assert deliver(body) == (200, "[accepted]")

    op.refresh_from_db()
    claim.refresh_from_db()
    assert (op.state, claim.state) == (OperationState.FAILED, ClaimState.FAILED)
    assert Order.objects.get(pk=op.params["order_id"]).status == OrderStatus.PAYMENT_FAILED


def test_notification__delivered_twice__the_second_changes_nothing(adyen, queue, notes):
    op, claim = lost_charge(adyen, queue)
    (body,) = notes.wait_for("AUTHORISATION")
    deliver(body)
    events = OperationEvent.objects.filter(operation=op).count()

    assert deliver(body) == (200, "[accepted]")

    assert Notification.objects.count() == 1
    assert OperationEvent.objects.filter(operation=op).count() == events
    claim.refresh_from_db()
    assert claim.state == ClaimState.DONE


def forged(body: dict, change) -> dict:
    copied = copy.deepcopy(body)
    change(item(copied))
    return copied


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda i: i.update(success="false"), id="changed-after-signing"),
        pytest.param(
            lambda i: i["additionalData"].update(hmacSignature=sign(i, "00" * 32)), id="other-key"
        ),
        pytest.param(lambda i: i["additionalData"].pop("hmacSignature"), id="unsigned"),
    ],
)
def test_notification__forged__refused_401_and_nothing_changes(adyen, queue, notes, forge):
    op, claim = lost_charge(adyen, queue)
    (body,) = notes.wait_for("AUTHORISATION")

    status, _ = deliver(forged(body, forge))

    assert status == 401
    assert Notification.objects.count() == 0
    claim.refresh_from_db()
    op.refresh_from_db()
    assert (claim.state, op.state) == (ClaimState.UNCERTAIN, OperationState.UNCERTAIN)
    assert deliver(body) == (200, "[accepted]")  # the genuine one still settles it
    claim.refresh_from_db()
    assert claim.state == ClaimState.DONE


def test_notification__signature__the_apps_rule_is_adyens_librarys_and_the_fakes():
    """The app's verifier, the fake's signer and Adyen's own library agree on Adyen's rule."""
    from Adyen.util import generate_notification_sig  # type: ignore[import-untyped]

    from payments.adyen.notifications import signed

    sample = {
        "pspReference": "ABCDEFGHIJKLMNOP",
        "originalReference": "",
        "merchantAccountCode": "ShopECOM",
        "merchantReference": "a:b",
        "amount": {"value": 100, "currency": "EUR"},
        "eventCode": "AUTHORISATION",
        "success": "true",
    }
    sample["additionalData"] = {"hmacSignature": sign(sample, HMAC_KEY)}

    assert signed(sample, HMAC_KEY)
    assert not signed(sample, "11" * 32)
    library = generate_notification_sig(sample, HMAC_KEY)
    assert sample["additionalData"]["hmacSignature"] == library.decode()


def test_refund_received_answer_lost__replayed_same_key__one_refund__settled_by_notification(
    adyen, queue, notes
):
    """The 201 was lost: the replay learns the refund's pspReference (Adyen replays the
    first answer, refunds nothing again); its REFUND notification then settles it."""
    shop = adyen_shop()
    order = create_order(amount=3000, currency="eur", email="r@example.com", client=shop)
    paid, _ = request_checkout(
        order_id=order.pk, key="paid-r", payment_method=CARD, actor="t", client=shop
    )
    run_worker(queue)
    refund, _ = request_refund(order_id=order.pk, key="lost-r", amount=3000, actor="t", client=shop)
    adyen.state.enqueue_faults("drop_after_accept")
    run_worker(queue)
    claim = refund.claims.get(step="refund")
    assert (claim.state, claim.provider_reference) == (ClaimState.UNCERTAIN, "")

    reconcile()

    claim.refresh_from_db()
    (body,) = notes.wait_for("REFUND")
    assert claim.state == ClaimState.UNCERTAIN  # received: the outcome is the notification's
    assert claim.provider_reference == item(body)["pspReference"]
    assert deliver(body) == (200, "[accepted]")
    run_worker(queue)
    refund.refresh_from_db()
    assert refund.state == OperationState.SUCCEEDED
    assert adyen.state.stats()["modifications"]["REFUND"] == 1
    assert Order.objects.get(pk=order.pk).status == OrderStatus.REFUNDED
