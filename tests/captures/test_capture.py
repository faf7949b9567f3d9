"""Manual capture, the third operation, built on the handler API alone (payments.fence).

Transactional: claims commit before their provider calls; workers run the jobs.
"""

from __future__ import annotations

import pytest

from payments.captures.handler import CaptureNotAllowed, describe, request_capture
from payments.checkout.orders import create_order
from payments.engine.failpoints import AFTER_PROVIDER_ACCEPT, hooked
from payments.engine.handlers import money_moved
from payments.models import ClaimState, Operation, OperationState
from payments.refunds.handler import RefundNotAllowed, request_refund
from payments.shop.models import Invoice, Order, OrderStatus
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def captured_order(queue, *, amount: int = 5000, capture: int | None = None) -> Operation:
    order = create_order(amount=amount, currency="eur", email="capture@example.com")
    op, _ = request_capture(
        order_id=order.pk,
        key=f"cap-{order.pk}",
        payment_method="pm_card_visa",
        amount_to_capture=capture,
        actor="test",
    )
    run_worker(queue)
    op.refresh_from_db()
    return op


def intent_of(provider, op: Operation) -> dict:
    (intent,) = provider.state.intents(metadata={"operation_key": op.key})
    return intent


def test_capture__holds_then_captures_part_and_invoices_what_was_captured(provider, queue):
    op = captured_order(queue, amount=5000, capture=3000)

    assert op.state == OperationState.SUCCEEDED
    intent = intent_of(provider, op)
    assert (intent["status"], intent["amount_received"]) == ("succeeded", 3000)
    order = Order.objects.get(pk=op.params["order_id"])
    assert order.status == OrderStatus.PAID
    assert Invoice.objects.get(order=order).amount == 3000
    assert dict(op.claims.values_list("step", "state")) == {
        "authorize": ClaimState.DONE,
        "capture": ClaimState.DONE,
        "record": ClaimState.DONE,
    }
    # The desk's and the audit's money is the effect's reading: captured, not asked for.
    assert money_moved(op) == (3000, "eur")
    assert describe(op) == f"€30.00 captured of a €50.00 hold, order {order.pk}"


def test_capture__sends_no_metadata_so_the_authorisation_keeps_naming_its_step(provider, queue):
    op = captured_order(queue, capture=1000)

    metadata = intent_of(provider, op)["metadata"]
    assert (metadata["operation_key"], metadata["step"]) == (op.key, "authorize")
    assert metadata["operation_id"] == str(op.pk)
    capture = op.claims.get(step="capture")
    assert "metadata" not in capture.request
    assert capture.provider_reference.startswith("ch_")


def test_refund_above_the_captured_amount__is_refused_before_any_call(provider, queue):
    op = captured_order(queue, amount=5000, capture=3000)
    order_id = op.params["order_id"]

    with pytest.raises(RefundNotAllowed):
        request_refund(order_id=order_id, key="too-much", amount=3001, actor="test")
    request_refund(order_id=order_id, key="all", amount=3000, actor="test")
    run_worker(queue)
    order = Order.objects.get(pk=order_id)
    assert (order.status, order.refunded_amount) == (OrderStatus.REFUNDED, 3000)


def test_capture_of_more_than_the_order__is_refused(provider, queue):
    order = create_order(amount=1000, currency="eur", email="capture@example.com")
    with pytest.raises(CaptureNotAllowed):
        request_capture(
            order_id=order.pk,
            key="big",
            payment_method="pm_card_visa",
            amount_to_capture=1001,
            actor="t",
        )


def test_capture_that_gives_up__releases_the_hold_under_its_own_claim(provider, queue):
    faults: list[int] = []

    def refuse_the_captures() -> None:
        if not faults:  # after the authorisation's 200: every capture try gets a 429
            faults.append(provider.state.enqueue_faults("rate_limit", 10))

    with hooked(AFTER_PROVIDER_ACCEPT, refuse_the_captures):
        op = captured_order(queue, amount=2000)

    op.refresh_from_db()
    assert op.state == OperationState.FAILED, op.last_error
    assert op.events.filter(to_state=OperationState.FAILED, reason__endswith="compensated").exists()
    intent = intent_of(provider, op)
    assert (intent["status"], intent["amount_capturable"]) == ("canceled", 0)
    release = op.claims.get(step="release")
    assert release.state == ClaimState.DONE
    assert release.idempotency_key not in {
        c.idempotency_key for c in op.claims.exclude(pk=release.pk)
    }
    order = Order.objects.get(pk=op.params["order_id"])
    assert order.status == OrderStatus.PAYMENT_FAILED


def test_declined_authorisation__fails_without_compensation(provider, queue):
    order = create_order(amount=2000, currency="eur", email="capture@example.com")
    op, _ = request_capture(
        order_id=order.pk, key="declined", payment_method="pm_card_chargeDeclined", actor="t"
    )
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert not op.claims.filter(step="release").exists()
    order.refresh_from_db()
    assert order.status == OrderStatus.PAYMENT_FAILED


def test_fence_audit__a_held_or_released_authorisation_is_no_finding_and_a_capture_is_fenced(
    provider, queue
):
    from django.core.management import call_command

    captured_order(queue, amount=5000, capture=3000)
    faults: list[int] = []

    def refuse_the_captures() -> None:
        if not faults:
            faults.append(provider.state.enqueue_faults("rate_limit", 10))

    with hooked(AFTER_PROVIDER_ACCEPT, refuse_the_captures):
        released = captured_order(queue, amount=2000)
    assert released.state == OperationState.FAILED

    call_command("fence_audit", "--since", "1h")  # exit 0: CommandError otherwise


def gave_up_and_compensated(provider, queue) -> Operation:
    faults: list[int] = []

    def refuse_the_captures() -> None:
        if not faults:  # after the authorisation's 200: every capture try gets a 429
            faults.append(provider.state.enqueue_faults("rate_limit", 10))

    with hooked(AFTER_PROVIDER_ACCEPT, refuse_the_captures):
        op = captured_order(queue, amount=2000)
    assert op.state == OperationState.FAILED
    return op


def test_a_compensated_capture__stays_failed_through_the_reconcilers_passes(provider, queue):
    """Its authorisation is done with a reference, yet the operation is not "stranded": it
    compensated on purpose. Its capture claim, released after the 429s, is settled failed,
    so no lookup finds the authorisation's intent and parks it for review."""
    from payments.engine.recovery import reconcile

    op = gave_up_and_compensated(provider, queue)
    assert op.claims.get(step="capture").state == ClaimState.FAILED
    events = op.events.count()

    for _ in range(3):
        reconcile(actor="recovery:test")
        run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert op.events.count() == events  # nothing resumed, nothing moved


class _Killed(BaseException):
    """The worker's death just after the provider's 200 (what a SIGKILL leaves behind)."""


def test_marking_a_held_capture_failed__cancels_the_hold(provider, queue):
    """An operator's "mark failed" voids the step: the intent is cancelled, so that no
    capture can follow and nothing stays held on the card."""
    from payments.engine.failpoints import AFTER_CLAIM_COMMIT
    from payments.engine.handlers import get_handler
    from payments.engine.runtime import execute
    from payments.engine.steps import view_of

    order = create_order(amount=2000, currency="eur", email="held@example.com")
    op, _ = request_capture(
        order_id=order.pk, key="held-1", payment_method="pm_card_visa", actor="test"
    )
    claims: list[int] = []

    def die_before_the_capture_is_sent() -> None:
        claims.append(1)
        if len(claims) == 2:  # the capture's claim committed; its request never sent
            raise _Killed

    with hooked(AFTER_CLAIM_COMMIT, die_before_the_capture_is_sent), pytest.raises(_Killed):
        execute(op.pk, worker_id="w1/1")
    claim = op.claims.get(step="capture")
    assert intent_of(provider, op)["status"] == "requires_capture"

    found = get_handler(op.kind).effect("capture", op).void(view_of(claim))

    assert found is not None and not found.succeeded
    intent = intent_of(provider, op)
    assert (intent["status"], intent["amount_capturable"]) == ("canceled", 0)


def test_a_run_that_dies_after_the_releases_200__resumes_the_compensation(provider, queue):
    """The redelivered run goes straight back to the compensation (its marker claim was
    committed before the release's call): the release replays under its own key, the
    capture is never tried again, and the operation fails, with nothing held."""
    import contextlib
    import time

    from payments.engine.runtime import execute
    from payments.exceptions import RetryLater

    order = create_order(amount=2000, currency="eur", email="die@example.com")
    op, _ = request_capture(
        order_id=order.pk, key="die-1", payment_method="pm_card_visa", actor="test"
    )
    faults: list[int] = []
    released: list[bool] = []

    def refuse_then_die() -> None:
        if not faults:
            faults.append(provider.state.enqueue_faults("rate_limit", 10))
        elif provider.state.intents(metadata={"operation_key": op.key})[0]["status"] == "canceled":
            released.append(True)
            raise _Killed  # after the release's 200, before it is recorded

    with hooked(AFTER_PROVIDER_ACCEPT, refuse_then_die), pytest.raises(_Killed):
        for attempt in range(3):  # two 429s, then the give-up's release, then the death
            with contextlib.suppress(RetryLater):
                execute(op.pk, worker_id=f"w{attempt}/1")
    assert released
    assert op.claims.get(step="release").state == ClaimState.CLAIMED
    time.sleep(3.5)  # the dead worker's leases run out (CLAIM_LEASE)

    assert execute(op.pk, worker_id="w9/1") == "failed"
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert op.claims.get(step="release").state == ClaimState.DONE
    assert op.claims.get(step="capture").state == ClaimState.FAILED
    intent = intent_of(provider, op)
    assert intent["status"] == "canceled"
    order.refresh_from_db()
    assert order.status == OrderStatus.PAYMENT_FAILED


def test_a_compensated_capture__not_listed_as_failed_before_anything_ran(provider, queue):
    """Needs attention lists what an outage refused before anything ran, for a new attempt.
    A capture whose authorisation was done (a hold made, then released) moved something:
    it is not one of those."""
    from payments.desk.views.nothing_ran import failed_before_running

    op = gave_up_and_compensated(provider, queue)
    assert op.claims.get(step="capture").error.startswith("gave up: ")

    assert op.pk not in failed_before_running()


def test_a_compensation_uncertain_then_completed__last_error_is_the_give_up_reason(
    provider, queue, monkeypatch
):
    """A review's catch: an uncertain compensation wrote "<reason>; compensation: <error>" as
    last_error, and the next run compensated with that as its reason, so the failed operation
    (and its released step) read as if the compensation had errored, a segment per round."""
    from payments.captures.effects import IntentRelease
    from payments.engine import recovery
    from payments.engine.outcomes import UncertainError

    faults: list[int] = []
    lost: list[bool] = []
    send = IntentRelease.send

    def refuse_the_captures() -> None:
        if not faults:  # after the authorisation's 200: every capture try gets a 429
            faults.append(provider.state.enqueue_faults("rate_limit", 10))

    def release_answer_lost_once(self, *args, **kwargs):
        answer = send(self, *args, **kwargs)
        if not lost:
            lost.append(True)
            raise UncertainError("POST cancel: read timeout")
        return answer

    monkeypatch.setattr(IntentRelease, "send", release_answer_lost_once)
    with hooked(AFTER_PROVIDER_ACCEPT, refuse_the_captures):
        op = captured_order(queue, amount=2000)
    assert op.state == OperationState.UNCERTAIN, op.last_error
    assert "compensation" not in op.last_error

    recovery.reconcile(actor="reconciler:t", operation_ids=[op.pk])
    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.FAILED, op.last_error
    assert "compensation" not in op.last_error
    assert "compensation" not in op.claims.get(step="capture").error
