"""Refunds have Stripe's states: pending is in flight, and a refund can fail after it succeeded.

Transactional, over real HTTP: workers run in this process, events are posted
signed to this app's endpoint, the fake provider moves refunds as Stripe does.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta

import pytest
from django.urls import reverse

from payments.desk import services as desk
from payments.desk.services import DeskError
from payments.engine import handlers
from payments.models import ClaimState, OperationState, ProviderEvent
from payments.refunds.handler import request_refund
from payments.refunds.names import REFUND_REVERSED, REFUND_STEP
from payments.shop.models import CreditNote, OrderStatus
from tests.support import builders
from tests.support.flows import order_and_checkout
from tests.support.users import RECONCILE, VIEW, client_for, make_user
from tests.support.workers import run_worker
from tests.webhooks.test_settling import deliver

pytestmark = pytest.mark.django_db(transaction=True)


def paid_and_refunded(provider, queue, amount: int = 500):
    order, _ = order_and_checkout()
    run_worker(queue)
    refund, _ = request_refund(order_id=order.pk, key="refund-1", amount=amount, actor="t")
    run_worker(queue)
    refund.refresh_from_db()
    order.refresh_from_db()
    return order, refund


def test_a_refund_that_fails_after_it_succeeded__gives_the_order_its_amount_back(
    provider_with_secret, queue, caplog
):
    """Hole: refund.failed after refund.created was filed as "stale": the order still showed
    the money refunded that the provider had given back, with no alert."""
    order, refund = paid_and_refunded(provider_with_secret, queue)
    assert (refund.state, order.status) == (OperationState.SUCCEEDED, "partially_refunded")
    reference = refund.claims.get(step=REFUND_STEP).provider_reference
    provider_with_secret.state.fail_refund(reference)
    events = [
        e
        for e in provider_with_secret.state.events()
        if e["type"] in ("refund.updated", "refund.failed")
    ]
    assert len(events) == 2

    with caplog.at_level(logging.ERROR, logger="payments.alerts"):
        for event in events:
            deliver(event)
        run_worker(queue)

    outcomes = sorted(ProviderEvent.objects.filter(pk__in=[e["id"] for e in events]).values_list(
        "outcome", flat=True
    ))  # fmt: skip
    assert outcomes == ["already_settled", "reversed"]  # reversed once, however often told
    order.refresh_from_db()
    assert (order.refunded_amount, order.status) == (0, OrderStatus.PAID)
    refund.refresh_from_db()
    assert refund.claims.get(step=REFUND_STEP).state == ClaimState.DONE  # it did succeed
    assert refund.claims.filter(step=REFUND_REVERSED).count() == 1
    assert any("reversed" in r.getMessage() for r in caplog.records if r.name == "payments.alerts")
    assert CreditNote.objects.count() == 1
    # What the provider gave back may be refunded again.
    again, created = request_refund(order_id=order.pk, key="refund-2", amount=500, actor="t")
    assert created


def test_a_pending_refund__is_in_flight_never_marked_failed(provider_with_secret, queue):
    """Hole: a pending refund was "not found": past the grace, "mark failed" failed a refund
    that later completed at the provider."""
    order, _ = order_and_checkout()
    run_worker(queue)
    provider_with_secret.state.configure(refund_status="pending")
    refund, _ = request_refund(order_id=order.pk, key="refund-1", amount=500, actor="t")
    run_worker(queue)
    refund.refresh_from_db()
    assert refund.state == OperationState.UNCERTAIN
    claim = refund.claims.get(step=REFUND_STEP)
    [pending] = provider_with_secret.state.refunds()
    assert claim.provider_reference == pending["id"]  # the pending refund names itself
    builders.backdate(claim, timedelta(days=2))  # long past the grace, past key retention
    operator = make_user("alice", *VIEW, RECONCILE)

    with pytest.raises(DeskError, match="still in progress at the provider"):
        desk.mark_step_failed(refund, REFUND_STEP, user=operator, reason="nothing came")

    claim.refresh_from_db()
    assert claim.state == ClaimState.UNCERTAIN
    provider_with_secret.state.complete_refund(pending["id"])
    [updated] = [
        e for e in provider_with_secret.state.events(type="refund.updated")
        if e["data"]["object"]["status"] == "succeeded"
    ]  # fmt: skip
    deliver(updated)
    run_worker(queue)

    refund.refresh_from_db()
    order.refresh_from_db()
    assert refund.state == OperationState.SUCCEEDED
    assert order.refunded_amount == 500


def test_a_refund_reversed_before_its_credit_note__writes_none_and_keeps_the_other_refunds(
    provider_with_secret, queue, monkeypatch
):
    """Review: a refund reversed while its credit note step had not run yet subtracted its
    amount from another refund's (clamped at 0), left a step no handler declares on an
    unfinished operation (payments.E010 refuses workers), and the resumed credit note then
    added the reversed amount back: the order showed money refunded that never was."""
    order, _ = order_and_checkout()  # 1999
    run_worker(queue)
    request_refund(order_id=order.pk, key="refund-0", amount=300, actor="t")
    run_worker(queue)

    def broken(operation, reference):
        raise RuntimeError("credit note numbering bug")

    with monkeypatch.context() as patch:
        patch.setattr("payments.refunds.handler.issue_credit_note", broken)
        refund, _ = request_refund(order_id=order.pk, key="refund-1", amount=1000, actor="t")
        run_worker(queue)
    claim = refund.claims.get(step=REFUND_STEP)
    assert claim.state == ClaimState.DONE
    provider_with_secret.state.fail_refund(claim.provider_reference)
    [failed] = provider_with_secret.state.events(type="refund.failed")

    deliver(failed)
    run_worker(queue)

    order.refresh_from_db()
    assert order.refunded_amount == 300  # refund-0's, untouched
    assert handlers.unknown_recorded_names() == []
    operator = make_user("alice", *VIEW, RECONCILE)
    refund.refresh_from_db()
    if refund.state != OperationState.SUCCEEDED:  # its credit note step runs again
        if refund.state != OperationState.RETRYING:
            desk.resume(refund, user=operator, reason="credit note bug fixed")
        run_worker(queue)
    refund.refresh_from_db()
    order.refresh_from_db()
    assert refund.state == OperationState.SUCCEEDED
    assert (order.refunded_amount, order.status) == (300, OrderStatus.PARTIALLY_REFUNDED)
    assert CreditNote.objects.count() == 1  # refund-0's only


def words(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


def figure(page: str, name: str) -> str:
    """One figure of the order page's Money box, with its label ("Net €20.00")."""
    return words(page.split(f'id="desk-{name}"', 1)[1].split("</div>", 1)[0].split(">", 1)[1])


def refund_rows(page: str) -> list[str]:
    table = page.split('id="desk-movements"', 1)[1].split("</table>", 1)[0]
    return [
        words("<tr" + row)
        for row in table.split("<tbody>", 1)[1].split("<tr")[1:]
        if "desk-movement-refund" in row.split(">", 1)[0]
    ]


def reversed_refund(provider, queue, amount: int = 500):
    """A paid order, refunded, then the refund failed at the provider (its events posted):
    the reversal recorded and the order reopened. Returns (order, the refund's reference)."""
    order, refund = paid_and_refunded(provider, queue, amount=amount)
    reference = refund.claims.get(step=REFUND_STEP).provider_reference
    provider.state.fail_refund(reference)
    for event in provider.state.events():
        if event["type"] in ("refund.updated", "refund.failed"):
            deliver(event)
    run_worker(queue)
    order.refresh_from_db()
    assert order.refunded_amount == 0
    return order, reference


def test_a_refund_the_provider_reversed__not_counted_refunded_on_the_desks_pages(
    provider_with_secret, queue
):
    """An operator's try: a refund that failed at the provider after it succeeded (reversed,
    the order reopened: the API says refunded 0) still read "Refunded €10.00 · Net €9.99"
    and "Succeeded" on the order's page, and the same on its refund page."""
    order, _ = reversed_refund(provider_with_secret, queue, amount=1000)

    page = (
        client_for(make_user("vera", *VIEW))
        .get(reverse("admin:shop_order_change", args=[order.pk]))
        .content.decode()
    )

    assert figure(page, "refunded").startswith("Refunded €0.00"), figure(page, "refunded")
    assert figure(page, "net") == "Net €19.99"
    (row,) = refund_rows(page)
    assert "reversed by the provider" in row, row
    refund_page = client_for(make_user("rita", *VIEW, "shop.refund_order")).get(
        reverse("admin:shop_order_refund", args=[order.pk])
    )
    assert refund_page.status_code == 200
    assert "Refunded €0.00" in words(refund_page.content.decode())


def test_a_refund_the_provider_reversed__no_audit_finding_once_its_reversal_is_recorded(
    provider_with_secret, queue
):
    """Needs attention showed "Open: rf-14/refund is still done with it", with nothing to
    press, and fence_audit exited 1 on every run: the claim stays done by design (the
    refund happened), its reversal recorded. A recorded reversal is no unknown refund."""
    import io

    from django.core.management import call_command

    _, reference = reversed_refund(provider_with_secret, queue)

    out = io.StringIO()
    call_command("fence_audit", "--since", "1h", stdout=out)  # exit 1 (CommandError) on a finding

    page = words(
        client_for(make_user("vera", *VIEW))
        .get(reverse("admin:payments_operation_needs_attention"))
        .content.decode()
    )
    assert "is still done with it" not in page
    assert reference not in page


def test_a_pending_refund_after_a_query__mark_failed_says_it_is_pending_not_that_nobody_asked(
    provider_with_secret, queue
):
    """An operator's loop: "Query the provider now" answered the refund pending, and the
    mark-failed page still said "nobody has asked the provider ... Query first"."""
    from payments.desk.views.actions import mark_failed_refusal

    order, _ = order_and_checkout()
    run_worker(queue)
    provider_with_secret.state.configure(refund_status="pending")
    refund, _ = request_refund(order_id=order.pk, key="refund-loop", amount=500, actor="t")
    run_worker(queue)
    operator = make_user("alice", *VIEW, RECONCILE)
    desk.query_provider([refund.pk], user=operator)  # the operator's "Query the provider now"
    refund = refund.__class__.objects.prefetch_related("claims").get(pk=refund.pk)

    why = mark_failed_refusal(refund, REFUND_STEP)

    assert "nobody has asked" not in why
    assert "in progress" in why and "may still succeed" in why, why
