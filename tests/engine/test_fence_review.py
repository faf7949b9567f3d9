"""Adversarial review of "close the fence's edges" (90145cd..da524ab).

Each test drives a real path (worker, reconciler, desk, fake provider over HTTP,
PostgreSQL) and is named for the behaviour it proves. Tests that fail on
da524ab demonstrate a defect; the others pin a behaviour verified to hold.
Transactional: claims commit before provider calls, other connections read them.
"""

from __future__ import annotations

import time

import pytest

from payments.checkout.charge import PaymentIntentCharge
from payments.checkout.handler import request_checkout
from payments.checkout.names import CHARGE, CHECKOUT
from payments.checkout.orders import create_order
from payments.desk import services as desk
from payments.engine import fence, handlers
from payments.engine.dispatch import dispatch
from payments.engine.recovery import reconcile
from payments.models import ClaimState, KeyScope, Operation, OperationState
from payments.shop.models import Invoice, Order, OrderStatus
from tests.support.builders import charge_effect
from tests.support.users import NEW_ATTEMPT, RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def checkout(key: str, *, amount: int = 1500, pm: str = "pm_card_visa", scope=KeyScope.CLIENT):
    order = create_order(amount=amount, currency="eur", email="review@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key=key, payment_method=pm, actor="test", scope=scope
    )
    return order, op


def successes(provider, order: Order) -> list[dict]:
    """Provider-side successful charges of the order, whatever key or operation made them."""
    return [
        intent
        for intent in provider.state.intents(metadata={"order_id": str(order.pk)})
        if intent["status"] == "succeeded"
    ]


def dead_worker_claim(op: Operation, step: str = CHARGE):
    """A worker committed the claim and died before sending (failpoint after_claim_commit)."""
    claim = fence.claim_step(
        op,
        step,
        owner="dead-worker/1",
        lease_seconds=1,
        request=charge_effect(op).build_request(),
    ).claim
    time.sleep(1.1)  # its lease runs out, by the database's clock
    return claim


@pytest.fixture
def senior(db):
    return make_user("review-senior", *VIEW, RECONCILE, NEW_ATTEMPT)


# --- F1. derived keys are scoped in the database, not at the provider -------------------


def test_new_attempt_is_never_settled_by_another_orders_charge_with_the_same_key(
    provider, queue, senior, settings
):
    """A desk new attempt gets the derived key `<first key> attempt 2`; a client may use the same
    string as its Idempotency-Key (the scopes keep both rows apart). The charge metadata
    carries the bare key, so the metadata search of one finds the other's charge."""
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_KEY_RETENTION": 3600}  # no replay
    order_y, first = checkout("y-first", amount=50_000, pm="pm_card_chargeDeclined")
    run_worker(queue)
    first.refresh_from_db()
    assert first.state == OperationState.FAILED
    attempt = desk.start_new_attempt(
        first, user=senior, reason="customer updated the card", payment_method="pm_card_visa"
    )
    assert attempt.scope == KeyScope.DERIVED
    queue.empty()
    # Another customer's order, checked out with the same string as a client key.
    order_x, other = checkout(attempt.key, amount=100)
    run_worker(queue)
    other.refresh_from_db()
    assert other.state == OperationState.SUCCEEDED and len(successes(provider, order_x)) == 1
    # The new attempt's worker died right after committing its claim: nothing was sent.
    dead_worker_claim(attempt)

    dispatch(attempt.pk)
    run_worker(queue)

    order_y.refresh_from_db()
    charge = attempt.claims.get(step=CHARGE)
    x_reference = other.claims.get(step=CHARGE).provider_reference
    assert charge.provider_reference != x_reference, "settled by another order's charge"
    assert not (order_y.status == OrderStatus.PAID and not successes(provider, order_y)), (
        "order Y is shown paid, but only order X was charged"
    )


# --- F2. E010 treats failed operations as finished; the engine resumes them -------------


def test_step_rename_with_a_charged_failed_operation__is_reported_before_it_charges_again(
    provider, queue, monkeypatch
):
    """A failed operation is not final: the stranded pass resumes a failed one whose
    charge is done, the desk resumes failed ones, the reconciler settles their claims.
    E010 (and the worker's start-up check) only looks at states outside
    FINAL_OPERATION_STATES, which include FAILED."""
    order, op = checkout("charged-then-failed")
    queue.empty()
    # The reconciler settled the charge of a failed operation, and died before moving it
    # (or the row predates this change): failed, charge done. Built with fence calls.
    claim = dead_worker_claim(op)
    taken = fence.take_over_claim(claim, owner="reconciler-a", lease_seconds=30)
    intent = charge_effect(op).perform(taken.request, taken.idempotency_key)
    fence.settle_claim(
        taken,
        ClaimState.DONE,
        actor="reconciler-a",
        reference=intent.reference,
        result=intent.as_result(),
    )
    from django.db import transaction

    fence.acquire_lease(op.pk, owner="w/1", seconds=30)
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        fence.release_in_tx(locked, OperationState.FAILED, actor="w/1", reason="gave up")
        Order.objects.filter(pk=order.pk).update(status=OrderStatus.PAYMENT_FAILED)
    assert len(successes(provider, order)) == 1
    # A deploy renames the step (the constant, as names.py invites, and the effects key).
    monkeypatch.setattr("payments.checkout.handler.CHARGE", "charge_v2")
    monkeypatch.setattr("payments.checkout.charge.CHARGE", "charge_v2")
    spec = handlers.get_handler(CHECKOUT)
    renamed = {"charge_v2": spec.effects[CHARGE]}
    monkeypatch.setitem(
        handlers._HANDLERS, CHECKOUT, handlers.HandlerSpec(**{**vars(spec), "effects": renamed})
    )

    problems = handlers.unknown_recorded_names()  # what E010 and FenceWorker.work() ask
    if not problems:  # nothing stopped the deploy: recovery runs as usual
        reconcile()
        run_worker(queue)

    assert len(successes(provider, order)) == 1, "charged again under the renamed step's key"
    assert problems, "E010 is silent about a charged operation the engine will resume"


# --- F3. the desk's "search may lag" margin runs on two hosts' clocks --------------------


def test_mark_failed_right_after_a_lost_answer_with_a_fast_web_clock__never_fails_a_charged_order(
    provider, queue, senior, monkeypatch
):
    """mark_step_failed used to trust "not found" once the claim was 60 s old by the web
    host's clock against the worker's (auto_now). Now the same-key replay or the grace
    period, on PostgreSQL's clock, decides: a fast web clock changes nothing."""
    from datetime import timedelta

    from django.utils import timezone

    provider.state.configure(search_lag=30, slow_delay=1.5)  # search lags; read times out
    provider.state.enqueue_faults("slow", 1)
    order, op = checkout("lost-answer")
    run_worker(queue)
    assert provider.state.wait_idle(timeout=5)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN and len(successes(provider, order)) == 1
    # The web host's clock runs 2 minutes ahead of the worker host's (NTP broken on one).
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(minutes=2))

    try:
        desk.mark_step_failed(op, CHARGE, user=senior, reason="provider shows nothing")
    except desk.DeskError:
        pass  # refused: "the provider's search may not show it yet"
    order.refresh_from_db()
    shown_failed = order.status == OrderStatus.PAYMENT_FAILED
    if shown_failed:  # its claim is failed too: the customer may pay again
        request_checkout(
            order_id=order.pk, key="lost-answer-2", payment_method="pm_card_visa", actor="api"
        )
        run_worker(queue)

    assert len(successes(provider, order)) == 1, "the order was charged twice"
    assert not shown_failed, "a charged order was marked failed inside the search-lag margin"


# --- pinned: ownership and the clock on the worker's own paths (verified to hold) --------


def test_worker_back_after_its_lease_ran_out__changes_nothing_and_the_order_is_charged_once(
    provider, queue
):
    """Worker A got the provider's 200 and stalled (GC, VM pause) past its leases; worker B
    took the operation and the claim over (uncertain), replayed the same key and finished.
    A's late outcome is queued in its open transaction, never sent: A's next step (its
    invoice, whose number B already used) finds the work done by B, A's transaction rolls
    back, its outcome's rewrite finds the claim B's and writes nothing, and nothing of A's
    commits after its charge's claim (payments.engine.unit)."""
    import threading

    from django.db import connection

    from payments.engine import failpoints
    from payments.engine.runtime import execute

    order, op = checkout("late-worker")
    queue.empty()
    paused, resume = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def stall_a() -> None:
        if threading.current_thread().name == "worker-a":
            paused.set()
            resume.wait(timeout=20)

    def worker_a() -> None:
        try:
            outcome["a"] = execute(op.pk, worker_id="worker-a/1")
        except Exception as exc:  # asserted below
            outcome["a"] = exc
        finally:
            connection.close()

    with failpoints.hooked(failpoints.AFTER_PROVIDER_ACCEPT, stall_a):
        a = threading.Thread(target=worker_a, name="worker-a")
        a.start()
        assert paused.wait(timeout=10)
        time.sleep(3.3)  # CLAIM_LEASE is 3 s in tests: both of A's leases run out
        outcome["b"] = execute(op.pk, worker_id="worker-b/2")
        resume.set()
        a.join(timeout=20)

    op.refresh_from_db()
    order.refresh_from_db()
    charge = op.claims.get(step=CHARGE)
    assert outcome["b"] == "succeeded"
    # "deferred": its invoice was done meanwhile (StepDoneMeanwhile); RQ's next look at
    # the operation finds it succeeded and skips it.
    assert outcome["a"] == "deferred", outcome
    assert op.state == OperationState.SUCCEEDED and order.status == OrderStatus.PAID
    assert charge.state == ClaimState.DONE and charge.claimed_by == "worker-b/2"
    assert len(successes(provider, order)) == 1
    assert Invoice.objects.filter(order=order).count() == 1
    by_a = set(op.events.filter(actor="worker-a/1").values_list("step", "to_state"))
    assert by_a == {("", "running"), (CHARGE, "claimed")}


def test_job_timeout_during_the_provider_call__claim_uncertain_then_one_charge(
    provider, queue, monkeypatch
):
    """RQ's own job timeout (JobTimeoutException) lands while the provider executes the
    charge (an answer dribbling in under the per-read timeout): call_effect marks the claim
    uncertain as its owner; the next attempt takes it over and replays the same key."""
    from payments.engine.recovery import sweep

    real_perform = PaymentIntentCharge.perform
    calls = []

    def charge_then_hang(self, request, idempotency_key):
        answer = real_perform(self, request, idempotency_key)
        calls.append(answer.reference)
        if len(calls) == 1:
            time.sleep(10)  # JOB_TIMEOUT is 3 s in tests
        return answer

    monkeypatch.setattr(PaymentIntentCharge, "perform", charge_then_hang)
    from rq import SimpleWorker

    order, op = checkout("job-timeout")
    SimpleWorker([queue], connection=queue.connection).work(burst=True, max_jobs=1)

    op.refresh_from_db()
    charge = op.claims.get(step=CHARGE)
    assert charge.state == ClaimState.UNCERTAIN and op.state == OperationState.RETRYING
    order.refresh_from_db()
    assert order.status == OrderStatus.PROCESSING

    sweep()  # RQ's retry needs a scheduler; the sweeper delivers it as well
    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED and order.status == OrderStatus.PAID
    assert len(successes(provider, order)) == 1
    assert len(set(calls)) == 1  # the replay returned the first charge
