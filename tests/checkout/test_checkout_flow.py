"""The checkout operation end to end: real PostgreSQL, real Redis, real HTTP to the fake.

Every test here is transactional (`transaction=True`): the fence commits its
claim before the provider call, so commit visibility is the thing under test.
"""

from __future__ import annotations

import logging

import pytest
from django.core import mail
from rq.registry import FailedJobRegistry

from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.orders import create_order
from payments.engine.dispatch import dispatch
from payments.engine.recovery import reconcile
from payments.exceptions import OperationConflict
from payments.models import ClaimState, Operation, OperationEvent, OperationState, StepClaim
from payments.shop.models import Invoice, Order, OrderStatus
from tests.support.provider import successes
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def checkout(order: Order, key: str = "key-1", pm: str = "pm_card_visa") -> Operation:
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method=pm, actor="test")
    return op


def new_order(amount: int = 1999) -> Order:
    return create_order(amount=amount, currency="eur", email="buyer@example.com")


def test_confirmation_email__states_the_amount_by_the_currency_exponent(
    provider, queue, mailoutbox
):
    """JPY has no minor unit: 5000 is ¥5,000, never "50.00"."""
    order = create_order(amount=5000, currency="jpy", email="buyer@example.com")
    checkout(order)

    run_worker(queue)

    assert len(mailoutbox) == 1
    assert "¥5,000" in mailoutbox[0].body
    assert "50.00" not in mailoutbox[0].body


def test_checkout__charges_once_invoices_emails_and_marks_paid(provider, queue):
    order = new_order()
    op = checkout(order)

    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert successes(provider, op) == 1
    claims = {c.step: c for c in op.claims.all()}
    assert set(claims) == {"charge", "invoice", "confirmation_email", "mark_paid"}
    assert all(c.state == ClaimState.DONE for c in claims.values())
    charge = claims["charge"]
    assert charge.provider_reference.startswith("pi_")
    assert charge.idempotency_key.startswith("fence_")
    invoice = Invoice.objects.get(order=order)
    assert invoice.provider_reference == charge.provider_reference
    assert len(mail.outbox) == 1
    assert charge.provider_reference in mail.outbox[0].body


def test_checkout__redelivered_job_after_success_charges_nothing(provider, queue):
    order = new_order()
    op = checkout(order)
    run_worker(queue)

    dispatch(op.pk)  # RQ hands the same operation back
    run_worker(queue)

    assert successes(provider, op) == 1
    assert Invoice.objects.filter(order=order).count() == 1
    assert len(mail.outbox) == 1
    assert provider.state.stats()["create_requests"] == 1


def test_checkout__same_key_same_params_returns_same_operation_and_enqueues_once(provider, queue):
    order = new_order()
    first, created = request_checkout(
        order_id=order.pk, key="k", payment_method="pm_card_visa", actor="t"
    )
    again, created_again = request_checkout(
        order_id=order.pk, key="k", payment_method="pm_card_visa", actor="t"
    )
    assert (created, created_again) == (True, False)
    assert first.pk == again.pk
    assert queue.count == 1


def test_checkout__same_key_other_params_is_a_conflict_and_charges_nothing(provider, queue):
    order, other = new_order(), new_order(amount=500)
    checkout(order, key="k")
    with pytest.raises(OperationConflict):
        checkout(order, key="k", pm="pm_card_mastercard")
    with pytest.raises(OperationConflict):
        checkout(other, key="k")
    assert Operation.objects.count() == 1
    other.refresh_from_db()
    assert other.status == OrderStatus.PENDING


def test_checkout__new_key_for_an_order_in_progress_is_refused(provider, queue):
    order = new_order()
    checkout(order, key="k1")
    with pytest.raises(CheckoutNotAllowed):
        checkout(order, key="k2")
    assert Operation.objects.count() == 1


def test_decline__fails_at_once_without_retry(provider, queue):
    order = new_order()
    op = checkout(order, pm="pm_card_chargeDeclined")

    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert op.attempts == 0
    assert order.status == OrderStatus.PAYMENT_FAILED
    claim = op.claims.get(step="charge")
    assert claim.state == ClaimState.FAILED
    assert claim.provider_reference.startswith("pi_")
    assert provider.state.stats()["create_requests"] == 1
    assert FailedJobRegistry(queue=queue).count == 0
    assert not Invoice.objects.exists()


def test_transient_500__retried_with_the_same_key_until_it_succeeds(provider, queue):
    provider.state.enqueue_faults("fail_before", 2)
    order = new_order()
    op = checkout(order)

    run_worker(queue)

    op.refresh_from_db()
    claim = op.claims.get(step="charge")
    assert op.state == OperationState.SUCCEEDED
    assert op.attempts == 2
    # Three requests; the take-over whose request was refused before it ran is taken off
    # the claim's attempts (it was no attempt at the money, nor a look-up).
    assert claim.attempts == 2
    assert provider.state.stats()["create_requests"] == 3
    stats = provider.state.stats()
    assert (stats["idempotency_keys"], stats["intents"]) == (1, 1)  # one key on every try
    assert successes(provider, op) == 1


def test_transient_500__three_attempts_then_failed_registry_and_alert(provider, queue, caplog):
    provider.state.enqueue_faults("fail_before", 5)
    order = new_order()
    op = checkout(order)

    with caplog.at_level(logging.ERROR, logger="payments.alerts"):
        run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert op.attempts == 3
    assert provider.state.stats()["create_requests"] == 3
    assert FailedJobRegistry(queue=queue).get_job_ids() == [op.job_id]
    assert any(op.key in r.getMessage() for r in caplog.records if r.name == "payments.alerts")
    assert successes(provider, op) == 0
    # Every try was refused before executing: the step is settled, nothing to reconcile.
    assert op.claims.get(step="charge").state == ClaimState.FAILED


def test_read_timeout__leaves_claim_uncertain_and_never_charges_twice(provider, queue):
    provider.state.configure(slow_delay=1.5)  # longer than the 1 s read timeout
    provider.state.enqueue_faults("slow", 1)
    order = new_order()
    op = checkout(order)

    run_worker(queue)

    op.refresh_from_db()
    claim = op.claims.get(step="charge")
    assert op.state == OperationState.UNCERTAIN
    assert claim.state == ClaimState.UNCERTAIN
    assert FailedJobRegistry(queue=queue).count == 0

    assert provider.state.wait_idle(timeout=5)  # the slow request completes at the provider
    report = reconcile()  # the reconciler settles it with the same key
    run_worker(queue)

    assert report.count("done") == 1
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert successes(provider, op) == 1


def test_malformed_job__fails_visibly_without_retry(provider, queue):
    from payments.engine.jobs import run_operation

    bad = queue.enqueue(run_operation, "not-an-id")
    missing = queue.enqueue(run_operation, 987654)
    run_worker(queue)

    failed = FailedJobRegistry(queue=queue).get_job_ids()
    assert set(failed) == {bad.id, missing.id}
    assert "MalformedJob" in queue.fetch_job(bad.id).latest_result().exc_string


def test_every_transition_is_audited(provider, queue):
    order = new_order()
    op = checkout(order)
    run_worker(queue)

    events = list(OperationEvent.objects.filter(operation=op).values_list("step", "to_state"))
    assert ("", "pending") in events
    assert ("", "running") in events
    assert ("", "succeeded") in events
    for step in ("charge", "invoice", "confirmation_email", "mark_paid"):
        assert (step, "done") in events
    assert StepClaim.objects.filter(operation=op).count() == 4
