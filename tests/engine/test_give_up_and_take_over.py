"""Where an operation goes when it stops trying, and what taking a claim over means.

Transactional: claims commit before provider calls, and the scenarios read
what a "dead" worker committed.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import timedelta

import pytest
from django.utils import timezone

from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.orders import create_order
from payments.engine import fence, handlers, messages
from payments.engine.dispatch import dispatch
from payments.engine.recovery import reconcile
from payments.engine.runtime import execute
from payments.engine.writes import fence_writes
from payments.models import ClaimState, Operation, OperationState, StepClaim
from payments.shop.models import OrderStatus
from tests.support.builders import charge_effect
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def new_checkout(key: str):
    order = create_order(amount=900, currency="eur", email="g@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key=key, payment_method="pm_card_visa", actor="test"
    )
    return order, op


def test_unreleased_claim_of_a_dead_worker__is_taken_over_as_uncertain(provider, queue):
    order, op = new_checkout("dead-owner")
    queue.empty()
    # A worker claimed the charge, sent it, and died: the claim is still its own.
    claim = fence.claim_step(
        op, "charge", owner="dead/1", lease_seconds=1, request={"amount": 900}
    ).claim
    with fence_writes():  # hand-made state, as the test says
        StepClaim.objects.filter(pk=claim.pk).update(lease_expires_at=timezone.now())

    taken = fence.take_over_claim(claim, owner="next/2", lease_seconds=30)

    assert taken.state == ClaimState.UNCERTAIN
    assert op.events.filter(
        step="charge", to_state="uncertain", reason__contains="may have run"
    ).exists()


def test_giving_up_with_a_call_that_may_have_run__is_uncertain_not_failed(provider, queue):
    order, op = new_checkout("maybe-ran")
    queue.empty()
    charge = fence.claim_step(
        op, "charge", owner="dead/1", lease_seconds=1, request=_request(op)
    ).claim
    with fence_writes():  # hand-made state, as the test says
        StepClaim.objects.filter(pk=charge.pk).update(lease_expires_at=timezone.now())
    provider.state.enqueue_faults("fail_before", 3)  # every replay refused before executing

    dispatch(op.pk)
    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN  # the dead worker's call may have charged
    assert op.claims.get(step="charge").state == ClaimState.UNCERTAIN
    assert order.status == OrderStatus.PROCESSING  # never told "payment failed"
    with pytest.raises(CheckoutNotAllowed):
        request_checkout(
            order_id=order.pk, key="second", payment_method="pm_card_visa", actor="test"
        )

    report = reconcile()  # the provider is fine again: the replay settles it
    run_worker(queue)

    assert report.count("done") == 1
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert provider.state.succeeded_count(metadata={"operation_key": op.key}) == 1


def test_giving_up_after_the_money_was_taken__needs_review_and_the_order_is_not_failed(
    provider, queue, monkeypatch, caplog
):
    def broken_invoice(order_id: int, reference: str) -> dict:
        raise RuntimeError("invoice numbering bug")

    monkeypatch.setattr("payments.checkout.handler.issue_invoice", broken_invoice)
    order, op = new_checkout("charged-then-bug")

    with caplog.at_level(logging.ERROR, logger="payments.alerts"):
        run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW
    assert op.claims.get(step="charge").state == ClaimState.DONE
    assert order.status == OrderStatus.PROCESSING
    assert any("needs_review" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckoutNotAllowed):
        request_checkout(
            order_id=order.pk, key="again", payment_method="pm_card_visa", actor="test"
        )


def test_settled_claim_is_not_taken_over__no_second_call(provider, queue):
    order, op = new_checkout("settled")
    run_worker(queue)
    claim = op.claims.get(step="charge")
    calls = provider.state.stats()["create_requests"]

    taken = fence.take_over_claim(claim, owner="late/9", lease_seconds=30)

    assert taken.state == ClaimState.DONE and taken.claimed_by != "late/9"
    assert provider.state.stats()["create_requests"] == calls


def test_reconciler_resumes_an_operation_stranded_between_settle_and_move(provider, queue):
    order, op = new_checkout("stranded")
    provider.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    # The reconciler settled the claim, then died before moving the operation.
    claim = op.claims.get(step="charge")
    intent = provider.state.intents(metadata={"operation_key": op.key})[0]
    taken = fence.take_over_claim(claim, owner="reconciler", lease_seconds=30)
    fence.settle_claim(
        taken,
        ClaimState.DONE,
        actor="reconciler",
        reference=intent["id"],
        result={"reference": intent["id"], "status": "succeeded"},
    )

    report = reconcile()
    run_worker(queue)

    assert report.count("resumed") == 1
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert provider.state.succeeded_count(metadata={"operation_key": op.key}) == 1


def test_operation_of_an_unknown_kind__needs_review_instead_of_looping(provider, queue, caplog):
    order, op = new_checkout("renamed")
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(kind="checkout_v0")

    with caplog.at_level(logging.ERROR, logger="payments.alerts"):
        outcome = execute(op.pk, worker_id="w/1")

    op.refresh_from_db()
    assert outcome == "needs_review"
    assert op.state == OperationState.NEEDS_REVIEW
    assert "checkout_v0" in op.last_error


def test_follow_up_error_after_its_commit__is_delivered_not_retried(provider, queue, monkeypatch):
    order, op = new_checkout("late-error")
    run_worker(queue)
    follow_up = Operation.objects.get(parent=op, kind="record_sale")
    assert follow_up.state == OperationState.SUCCEEDED

    def committed_then_timed_out(operation_id: int, worker_id: str) -> str:
        raise TimeoutError("job time ran out on the way back")

    spec = handlers.get_handler("record_sale")
    monkeypatch.setitem(
        handlers._HANDLERS, "record_sale", replace(spec, func=committed_then_timed_out)
    )
    outcome = messages.deliver(follow_up.pk, worker_id="w/1")

    follow_up.refresh_from_db()
    assert outcome == "delivered"
    assert follow_up.state == OperationState.SUCCEEDED
    assert follow_up.attempts == 0


def _request(op: Operation) -> dict:

    return charge_effect(op).build_request()


def test_released_claim_after_transient_failures__is_taken_over_as_claimed(provider, queue):
    order, op = new_checkout("released")
    queue.empty()
    claim = fence.claim_step(
        op, "charge", owner="w/1", lease_seconds=30, request=_request(op)
    ).claim
    fence.release_claim(claim, actor="w/1", reason="connection refused")

    taken = fence.take_over_claim(claim, owner="w/2", lease_seconds=30)

    assert taken.state == ClaimState.CLAIMED  # nothing ran: retry freely with the same key
    assert taken.lease_expires_at > timezone.now() + timedelta(seconds=20)


def test_reconciler_resumes_a_failed_operation_whose_charge_was_settled_done(provider, queue):
    order, op = new_checkout("failed-but-charged")
    provider.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    # The reconciler settled the charge done, then died before moving the
    # operation, which an operator had failed meanwhile.
    claim = op.claims.get(step="charge")
    intent = provider.state.intents(metadata={"operation_key": op.key})[0]
    taken = fence.take_over_claim(claim, owner="reconciler", lease_seconds=30)
    fence.settle_claim(
        taken,
        ClaimState.DONE,
        actor="reconciler",
        reference=intent["id"],
        result={"reference": intent["id"], "status": "succeeded"},
    )
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(state=OperationState.FAILED)
    order.status = OrderStatus.PAYMENT_FAILED
    order.save(update_fields=["status"])

    report = reconcile()
    run_worker(queue)

    assert report.count("resumed") == 1
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert provider.state.succeeded_count(metadata={"operation_key": op.key}) == 1
