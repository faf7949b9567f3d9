"""The reconciler and the sweeper against the real fake provider and real Redis.

Transactional: the fence commits claims before provider calls, and the
reconciler reads what workers committed.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rq.intermediate_queue import IntermediateQueue
from rq.job import JobStatus

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine import failpoints, fence
from payments.engine.dispatch import dispatch
from payments.engine.jobs import run_operation
from payments.engine.recovery import job_is_live, reconcile, sweep
from payments.engine.writes import fence_writes
from payments.models import ClaimState, Operation, OperationState, StepClaim
from payments.provider.client import ProviderClient
from payments.shop.models import Order, OrderStatus
from tests.support.provider import successes
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def uncertain_checkout(provider, queue, *, key: str = "rec-1", card: str = "pm_card_visa"):
    """A checkout whose charge answer was lost (accepted, then the connection dropped)."""
    provider.state.enqueue_faults("drop_after_accept", 1)
    order = create_order(amount=4200, currency="eur", email="rec@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method=card, actor="test")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    return order, op


def test_reference_found_succeeded__step_done_and_operation_finishes(provider, queue):
    order, op = uncertain_checkout(provider, queue)
    intent = provider.state.intents(metadata={"operation_key": op.key})[0]
    with fence_writes():  # hand-made state, as the test says
        op.claims.filter(step="charge").update(provider_reference=intent["id"])

    report = reconcile()
    run_worker(queue)

    assert report.count("done") == 1
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert successes(provider, op) == 1
    assert provider.state.stats()["create_requests"] == 1  # looked up, not called again


def test_reference_found_declined__step_and_operation_fail(provider, queue):
    order, op = uncertain_checkout(provider, queue, card="pm_card_chargeDeclined")
    intent = provider.state.intents(metadata={"operation_key": op.key})[0]
    with fence_writes():  # hand-made state, as the test says
        op.claims.filter(step="charge").update(provider_reference=intent["id"])

    report = reconcile()

    assert report.count("failed") == 1
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert op.claims.get(step="charge").state == ClaimState.FAILED
    assert order.status == OrderStatus.PAYMENT_FAILED


def test_replay_with_the_same_key__returns_the_original_charge(provider, queue):
    order, op = uncertain_checkout(provider, queue)

    report = reconcile()
    run_worker(queue)

    assert report.count("done") == 1
    claim = op.claims.get(step="charge")
    assert claim.provider_reference == provider.state.intents()[0]["id"]
    assert provider.state.stats()["replays"] == 1
    assert successes(provider, op) == 1


def test_not_found_within_grace__stays_uncertain_then_needs_review_after(provider, queue, settings):
    order, op = uncertain_checkout(provider, queue)
    provider.state.reset()  # the provider lost it, or search has not caught up
    # Older than the provider's key retention: a replay could charge anew, so
    # only a search is allowed.
    old = timezone.now() - timedelta(hours=23, minutes=30)
    with fence_writes():  # hand-made state, as the test says
        op.claims.filter(step="charge").update(claimed_at=old, last_request_at=old)
    settings.PAYMENTS = {**settings.PAYMENTS, "RECONCILE_GRACE": 48 * 3600}

    within = reconcile()

    assert within.count("still_uncertain") == 1
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    assert provider.state.stats()["create_requests"] == 0

    settings.PAYMENTS = {**settings.PAYMENTS, "RECONCILE_GRACE": 3600}
    after = reconcile()

    assert after.count("needs_review") == 1
    op.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW
    assert op.claims.get(step="charge").state == ClaimState.UNCERTAIN
    assert provider.state.stats()["create_requests"] == 0  # never a new charge


def test_provider_down_during_reconciliation__stays_uncertain_without_crashing(provider, queue):
    order, op = uncertain_checkout(provider, queue)
    provider.stop()

    report = reconcile()

    assert report.count("retry_later") == 1
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    assert op.claims.get(step="charge").state == ClaimState.UNCERTAIN


def test_reconciler_never_replays_for_a_failed_operation(provider, queue):
    """An operation that gave up may only be looked up: a replay could charge it now."""
    provider.state.enqueue_faults("fail_before", 3)
    order = create_order(amount=100, currency="eur", email="x@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="gave-up", payment_method="pm_card_visa", actor="test"
    )
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    with fence_writes():  # hand-made state, as the test says
        op.claims.filter(step="charge").update(state=ClaimState.CLAIMED, lease_expires_at=None)

    reconcile()

    assert provider.state.stats()["create_requests"] == 3  # lookups only afterwards
    assert successes(provider, op) == 0


def test_sweeper_after_a_redis_flush__every_operation_finishes_once(provider, queue, redis_conn):
    orders = [create_order(amount=100 + i, currency="eur", email="s@example.com") for i in range(5)]
    ops = [
        request_checkout(
            order_id=o.pk, key=f"flush-{o.pk}", payment_method="pm_card_visa", actor="test"
        )[0]
        for o in orders
    ]
    redis_conn.flushdb()  # every queued job is gone
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.update(dispatched_at=timezone.now() - timedelta(minutes=1))

    report = sweep()
    run_worker(queue)

    assert len(report.dispatched) == 5
    for op in ops:
        op.refresh_from_db()
        assert op.state == OperationState.SUCCEEDED
        assert successes(provider, op) == 1
    assert Order.objects.filter(status=OrderStatus.PAID).count() == 5


def test_sweeper_leaves_live_jobs_alone(provider, queue):
    order = create_order(amount=100, currency="eur", email="s@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="live", payment_method="pm_card_visa", actor="test"
    )
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.update(dispatched_at=timezone.now() - timedelta(minutes=1))

    report = sweep(dry_run=True)

    assert report.live == 1 and report.dispatched == []
    assert queue.count == 1


def test_started_job_of_a_dead_worker__is_not_live_once_the_lease_ran_out(provider, queue):
    order = create_order(amount=100, currency="eur", email="s@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="dead", payment_method="pm_card_visa", actor="test"
    )
    job = queue.fetch_job(Operation.objects.get(pk=op.pk).job_id)
    job.set_status(JobStatus.STARTED)
    now = timezone.now()
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(
            state=OperationState.RUNNING, lease_owner="dead/1", lease_expires_at=now + timedelta(5)
        )
    assert job_is_live(Operation.objects.get(pk=op.pk), now)

    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(lease_expires_at=now - timedelta(seconds=1))

    assert not job_is_live(Operation.objects.get(pk=op.pk), now)
    assert [k for k in sweep().dispatched] == ["dead"]


def test_an_operation_whose_worker_died__goes_back_to_the_front_of_the_queue(provider, queue):
    """It had left the queue already (and may have charged): new checkouts wait behind it."""
    order = create_order(amount=100, currency="eur", email="s@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="interrupted", payment_method="pm_card_visa", actor="test"
    )
    queue.empty()  # its worker took the job, then died
    now = timezone.now()
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(
            state=OperationState.RUNNING,
            lease_owner="dead/1",
            lease_expires_at=now - timedelta(seconds=1),
        )
    backlog = [
        request_checkout(
            order_id=create_order(amount=100, currency="eur", email=f"n{i}@example.com").pk,
            key=f"new-{i}",
            payment_method="pm_card_visa",
            actor="test",
        )[0].pk
        for i in range(2)
    ]

    assert sweep().dispatched == ["interrupted"]

    assert [queue.fetch_job(j).args[0] for j in queue.job_ids] == [op.pk, *backlog]


def test_queued_job_a_killed_worker_had_dequeued__is_not_live(provider, queue):
    """RQ moves a job to its intermediate queue as a worker takes it; SIGKILLed before the
    started registry knew, the job stays there, its status still `queued`."""
    order = create_order(amount=100, currency="eur", email="s@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="dequeued", payment_method="pm_card_visa", actor="test"
    )
    op.refresh_from_db()
    intermediate = IntermediateQueue(queue.key, connection=queue.connection)
    queue.connection.lmove(queue.key, intermediate.key, "LEFT", "RIGHT")  # the worker's dequeue
    assert queue.fetch_job(op.job_id).get_status() == JobStatus.QUEUED
    assert queue.count == 0

    assert not job_is_live(op, timezone.now())

    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(
            dispatched_at=timezone.now() - timedelta(minutes=1)
        )
    assert sweep().dispatched == ["dequeued"]
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert successes(provider, op) == 1


def test_deferred_job__meets_a_live_lease_and_schedules_a_recheck(provider, queue):
    order = create_order(amount=100, currency="eur", email="s@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="busy", payment_method="pm_card_visa", actor="test"
    )
    held = fence.acquire_lease(op.pk, owner="other-worker/1", seconds=30)
    assert held.acquired

    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.RUNNING  # untouched: the other worker owns it
    assert op.attempts == 0
    scheduled = queue.scheduled_job_registry.get_job_ids()
    assert scheduled == [op.job_id]
    assert provider.state.stats()["create_requests"] == 0


def test_requeue_from_failed_registry_after_success__charges_nothing(provider, queue):
    order = create_order(amount=100, currency="eur", email="s@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="requeue", payment_method="pm_card_visa", actor="test"
    )
    run_worker(queue)
    stale = queue.enqueue(run_operation, op.pk)  # an old job an operator requeues
    run_worker(queue)

    assert queue.fetch_job(stale.id).return_value() == "skipped:succeeded"
    assert successes(provider, op) == 1


def test_dispatch_for_an_unknown_operation_is_an_error(provider, queue):
    with pytest.raises(Operation.DoesNotExist):
        dispatch(123456789)


def test_client_lists_every_charge_of_the_run(provider, queue):
    for i in range(3):
        order = create_order(amount=100 + i, currency="eur", email="s@example.com")
        request_checkout(
            order_id=order.pk, key=f"list-{i}", payment_method="pm_card_visa", actor="test"
        )
    run_worker(queue)
    client = ProviderClient(provider.url, "sk_test_x", connect_timeout=1, read_timeout=2)
    assert len(list(client.list_payment_intents(limit=2))) == 3


def _failed_with_unsettled_charge(provider, queue, key: str):
    """An operation that gave up while its charge's outcome was not settled (409 case)."""
    provider.state.enqueue_faults("fail_before", 3)
    order = create_order(amount=300, currency="eur", email="u@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key=key, payment_method="pm_card_visa", actor="test"
    )
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    with fence_writes():  # hand-made state, as the test says
        op.claims.filter(step="charge").update(state=ClaimState.CLAIMED, lease_expires_at=None)
    return order, op


def test_failed_operation_found_charged__reopens_the_order_and_finishes(provider, queue):
    order, op = _failed_with_unsettled_charge(provider, queue, "found-later")
    claim = op.claims.get(step="charge")
    # The request that met a 409 did go through at the provider after all.
    client = ProviderClient(provider.url, "sk_test_x", connect_timeout=1, read_timeout=2)
    client.create_payment_intent(
        amount=300,
        currency="eur",
        payment_method="pm_card_visa",
        metadata=claim.request["metadata"],  # what the worker's request carried
        idempotency_key=claim.idempotency_key,
    )
    order.refresh_from_db()
    assert order.status == OrderStatus.PAYMENT_FAILED

    report = reconcile()
    order.refresh_from_db()
    assert report.count("done") == 1
    assert order.status == OrderStatus.PROCESSING  # reopened in the resuming transaction
    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert successes(provider, op) == 1


def test_new_checkout_is_refused_while_an_earlier_charge_is_unsettled(provider, queue):
    from payments.checkout.handler import CheckoutNotAllowed

    order, op = _failed_with_unsettled_charge(provider, queue, "unsettled")

    with pytest.raises(CheckoutNotAllowed, match="may still have charged"):
        request_checkout(
            order_id=order.pk, key="second-try", payment_method="pm_card_visa", actor="test"
        )
    assert not Operation.objects.filter(key="second-try").exists()


def test_scheduled_job_no_scheduler_picked_up__is_delivered_anew(provider, queue):
    """RQ retried an abandoned job with a backoff, but no scheduler runs (its holder died)."""
    order = create_order(amount=100, currency="eur", email="s@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="stale-retry", payment_method="pm_card_visa", actor="test"
    )
    op.refresh_from_db()
    job = queue.fetch_job(op.job_id)
    queue.remove(job)
    now = timezone.now()
    queue.scheduled_job_registry.schedule(job, now - timedelta(seconds=5))
    job.set_status(JobStatus.SCHEDULED)
    assert job_is_live(op, now)  # due 5 s ago: a scheduler may still pick it up

    later = now + timedelta(seconds=60)
    assert not job_is_live(op, later)

    queue.scheduled_job_registry.schedule(job, now - timedelta(minutes=2))
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(dispatched_at=now - timedelta(minutes=2))
    assert sweep().dispatched == ["stale-retry"]
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED


def test_a_replay__records_when_it_was_sent_before_it_goes_out(provider, queue):
    """ "Not found" counts from the last request under the key: the reconciler's same-key
    replay records its time (committed) before it is sent, whatever then happens to it."""
    order, op = uncertain_checkout(provider, queue)
    claim = op.claims.get(step="charge")
    first = claim.last_request_at
    assert first == claim.claimed_at  # the claimant's own request
    seen: list[object] = []

    def at_send() -> None:  # where the request is about to leave: the time is committed
        seen.append(StepClaim.objects.get(pk=claim.pk).last_request_at)

    provider.state.enqueue_faults("drop_after_accept", 1)  # the replay's answer is lost too
    with failpoints.hooked(failpoints.AFTER_CLAIM_COMMIT, at_send):
        reconcile()

    claim.refresh_from_db()
    assert len(seen) == 1 and seen[0] is not None and seen[0] > first
    assert claim.last_request_at == seen[0]


def test_a_replay_that_could_not_connect__puts_the_last_request_time_back(
    provider, queue, settings
):
    """Nothing was sent (connection refused: transient), so the grace still counts from the
    request before: a provider that stays down still reaches review."""
    order, op = uncertain_checkout(provider, queue)
    before = op.claims.get(step="charge").last_request_at
    provider.stop()

    reconcile()

    claim = op.claims.get(step="charge")
    assert claim.last_request_at == before
    assert claim.state == ClaimState.UNCERTAIN


def test_run_recovery__says_it_runs_and_how_often__a_quiet_round_prints_nothing_more(queue):
    """An operator starting run_recovery sees it alive; a round with nothing to do is
    silent (no line every 10 s in the logs)."""
    import signal
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    call_command("run_recovery", "--once", stdout=out)

    assert out.getvalue() == "run_recovery: one round (a sweep and a reconcile)\n"
    # One round leaves the caller's signal handlers as they were (a test runner's Ctrl-C).
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
