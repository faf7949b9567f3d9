"""A provider incident: answers held in flight, dropped, or not given, for minutes.

What the reconciler does while the provider does not answer (it reads what it
can, keeps what it saw as evidence, counts looks instead of writing audit rows,
waits longer between looks) and after (what the incident parked settles without
a person). Real fake provider over HTTP, real PostgreSQL and Redis.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine import fence
from payments.engine.recovery import reconcile
from payments.engine.writes import fence_writes
from payments.models import ClaimLook, ClaimState, LookShowed, OperationEvent, OperationState
from payments.shop.models import OrderStatus
from tests.support.provider import successes
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

#: A port nothing listens on: every request is refused (the provider is down).
DOWN = "http://127.0.0.1:9"


def held_checkout(provider, queue, *, key: str, card: str = "pm_card_visa", hold: float = 4.0):
    """A checkout whose charge the provider executed and holds in flight for `hold` s.

    The worker's read times out (1 s in tests): the charge is uncertain, and every
    same-key request meanwhile is answered `409 idempotency_key_in_use`.
    """
    provider.state.configure(slow_delay=hold)
    provider.state.enqueue_faults("slow", 1)
    order = create_order(amount=7450, currency="eur", email="held@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method=card, actor="test")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    return order, op


def dropped_checkout(provider, queue, *, key: str):
    """A checkout whose charge succeeded at the provider and whose answer was dropped."""
    provider.state.enqueue_faults("drop_after_accept", 1)
    order = create_order(amount=4200, currency="eur", email="drop@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method="pm_card_visa", actor="t")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    return order, op


def audit_rows(op) -> int:
    return OperationEvent.objects.filter(operation=op).count()


def test_key_in_flight__the_consistent_list_is_read__its_success_settles(provider, queue):
    """Finding 2: a `409 ..._in_use` is not a failed read; the list shows the charge."""
    order, op = held_checkout(provider, queue, key="inc-held-ok")

    report = reconcile()
    run_worker(queue)

    assert report.count("done") == 1, report.outcomes
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert successes(provider, op) == 1
    claim = op.claims.get(step="charge")
    assert claim.look.in_flight_since is not None  # the 409 was kept as evidence


def test_key_in_flight__a_decline_read_meanwhile__waits_for_the_request_then_fails(
    provider, queue, settings
):
    """Finding 1: a decline seen while the request is in flight is evidence, not yet a
    verdict: the claim waits (in flight since ...), then the request's own answer settles."""
    order, op = held_checkout(
        provider, queue, key="inc-held-declined", card="pm_card_chargeDeclined"
    )
    settings.PAYMENTS = {**settings.PAYMENTS, "RECONCILE_GRACE": 1}
    time.sleep(1.1)  # past the grace since the request: in flight, it still never parks

    during = reconcile()

    assert during.count("still_uncertain") == 1, during.outcomes
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN  # never parked while in flight
    claim = op.claims.get(step="charge")
    assert claim.state == ClaimState.UNCERTAIN
    assert claim.look.in_flight_since is not None
    assert claim.provider_view["status"] == "requires_payment_method"  # what the list showed
    assert claim.provider_view["amount"] == 7450

    assert provider.state.wait_idle(timeout=10)  # the provider answers its request
    after = reconcile(operation_ids=[op.pk])

    assert after.count("failed") == 1, after.outcomes
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert order.status == OrderStatus.PAYMENT_FAILED
    assert successes(provider, op) == 0


def test_looks_that_learn_nothing__count_on_the_claim__write_no_audit_row(
    provider, queue, settings
):
    """Finding 4: every look at an unreadable provider wrote 1-2 audit rows."""
    _, op = dropped_checkout(provider, queue, key="inc-quiet")
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": DOWN}
    reconcile(operation_ids=[op.pk])
    rows = audit_rows(op)

    for _ in range(5):
        assert reconcile(operation_ids=[op.pk]).count("retry_later") == 1

    assert audit_rows(op) == rows
    look = ClaimLook.objects.get(claim__operation=op)
    assert look.looks == 6
    assert look.showed == LookShowed.UNREADABLE
    assert "ConnectionError" in look.detail or "Connect" in look.detail  # the real error
    assert look.unread_since is not None
    claim = op.claims.get(step="charge")
    assert claim.lease_expires_at is None  # left free for the desk or a worker at once


def test_looks_that_learn_nothing__each_waits_longer__up_to_a_minute(provider, queue, settings):
    """An incident's looks back off: the periodic round skips a claim not due yet."""
    _, op = dropped_checkout(provider, queue, key="inc-wait")
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": DOWN}

    first = reconcile()
    second = reconcile()

    assert first.count("retry_later") == 1
    assert second.examined == 0  # not due: its next look is 5 s on
    look = ClaimLook.objects.get(claim__operation=op)
    assert look.next_look_at - look.last_look_at == fence.LOOK_WAIT_FIRST
    waits = [fence.look_wait(LookShowed.UNREADABLE, streak) for streak in range(1, 9)]
    assert waits == sorted(waits)
    assert waits[-1] == fence.LOOK_WAIT_MOST == timedelta(seconds=60)


def test_an_incident_that_ends__what_it_parked_settles_without_a_person(
    provider, queue, settings, monkeypatch
):
    """Parked in needs_review for want of an answer; the provider answers again; the
    reconciler settles it by the same consistent reads, whatever the grace."""
    monkeypatch.setattr(fence, "LOOK_WAIT_FIRST", timedelta(0))  # every round looks
    order, op = dropped_checkout(provider, queue, key="inc-parked")
    working = settings.PAYMENTS["PROVIDER_URL"]
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": DOWN, "RECONCILE_GRACE": 1}
    time.sleep(1.1)  # past the grace: the first unanswered look parks it

    parked = reconcile()
    op.refresh_from_db()
    assert parked.count("needs_review") == 1
    assert op.state == OperationState.NEEDS_REVIEW
    rows = audit_rows(op)
    for _ in range(3):  # still down: still parked, nothing written
        assert reconcile().count("needs_review") == 1
    assert audit_rows(op) == rows

    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": working}
    after = reconcile()
    run_worker(queue)

    assert after.count("done") == 1, after.outcomes
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert successes(provider, op) == 1


def test_a_contradiction_is_held__the_reconciler_stops_looking(provider, queue, settings):
    """Only what the evidence cannot decide stays for review: a key conflict is held."""
    _, op = dropped_checkout(provider, queue, key="inc-held-for-person")
    claim = op.claims.get(step="charge")
    fence.hold_looks(claim, "a contradiction a person must see")
    with fence_writes():  # hand-made state, as the test says
        type(op).objects.filter(pk=op.pk).update(state=OperationState.NEEDS_REVIEW)

    report = reconcile()

    assert report.examined == 0
    op.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW
