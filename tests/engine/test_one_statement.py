"""Each transition on a worker's path is one statement: one round trip, its audit row inside.

Counted at the connection (devtools.bench.dbcount: statements, BEGIN, COMMIT,
health checks) outside any transaction, as a worker runs them: the statement
is its own transaction, so the count is the whole cost of the transition.
Each test also checks what the statement did (state, owner, audit row) and
that a refused transition changed nothing.
"""

from __future__ import annotations

import pytest

from devtools.bench.dbcount import RoundTrips, counting
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine import fence
from payments.exceptions import IllegalTransition, NotClaimOwner
from payments.models import (
    ClaimState,
    Operation,
    OperationEvent,
    OperationState,
    StepClaim,
)
from tests.conftest import BEGIN_WITH_FIRST_STATEMENT, STOCK

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "worker-a/1"


def pending_checkout(key: str = "one-1") -> Operation:
    order = create_order(amount=1200, currency="eur", email="one@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method="pm_card_visa", actor="t")
    return op


def trips(counter) -> RoundTrips:
    """The round trips counted, less the Parse a statement's first run on a connection sends
    (the fence prepares its statements: paid once per connection, not per transition)."""
    counted = counter.snapshot()
    counted.prepares = 0
    return counted


def audit(op: Operation) -> list[tuple[str, str, str, str]]:
    return list(
        OperationEvent.objects.filter(operation=op)
        .order_by("id")
        .values_list("step", "from_state", "to_state", "actor")
    )


def test_acquire_lease__one_round_trip_with_its_audit_row(queue):
    op = pending_checkout()

    with counting() as counter:
        leased = fence.acquire_lease(op.pk, owner=WORKER, seconds=30)

    assert leased.acquired
    assert trips(counter).total == 1
    assert (trips(counter).begins, trips(counter).commits) == (0, 0)
    op.refresh_from_db()
    assert (op.state, op.lease_owner) == (OperationState.RUNNING, WORKER)
    assert audit(op)[-1] == ("", OperationState.PENDING, OperationState.RUNNING, WORKER)


def test_acquire_lease__a_live_lease_of_another_worker_is_left_alone(queue):
    op = pending_checkout()
    fence.acquire_lease(op.pk, owner=WORKER, seconds=30)
    before = audit(op)

    other = fence.acquire_lease(op.pk, owner="worker-b/2", seconds=30)

    assert not other.acquired
    op.refresh_from_db()
    assert op.lease_owner == WORKER
    assert audit(op) == before


def test_claim_then_settle__one_round_trip_each(queue):
    op = fence.acquire_lease(pending_checkout().pk, owner=WORKER, seconds=30).operation

    with counting() as counter:
        claimed = fence.claim_step(op, "charge", owner=WORKER, lease_seconds=30, request={"a": 1})
    claim_trips = trips(counter)
    with counting() as counter:
        settled = fence.settle_claim(
            claimed.claim, ClaimState.DONE, actor=WORKER, reference="pi_1", result={"r": 1}
        )

    assert claimed.created and claim_trips.total == 1
    assert trips(counter).total == 1
    row = StepClaim.objects.get(pk=claimed.claim.pk)
    assert (row.state, row.provider_reference, row.result) == (ClaimState.DONE, "pi_1", {"r": 1})
    assert row.request == {"a": 1} and row.idempotency_key and row.settled_at is not None
    assert settled.state == ClaimState.DONE
    assert audit(op)[-2:] == [
        ("charge", "", ClaimState.CLAIMED, WORKER),
        ("charge", ClaimState.CLAIMED, ClaimState.DONE, WORKER),
    ]


def test_claim_of_a_taken_step__returns_the_row_and_writes_nothing(queue):
    op = fence.acquire_lease(pending_checkout().pk, owner=WORKER, seconds=30).operation
    first = fence.claim_step(op, "charge", owner=WORKER, lease_seconds=30)
    before = audit(op)

    second = fence.claim_step(op, "charge", owner="worker-b/2", lease_seconds=30)

    assert not second.created and second.claim.pk == first.claim.pk
    assert second.claim.claimed_by == WORKER
    assert audit(op) == before


def test_settle__refused_for_another_owner_and_for_a_settled_claim(queue):
    op = fence.acquire_lease(pending_checkout().pk, owner=WORKER, seconds=30).operation
    claim = fence.claim_step(op, "charge", owner=WORKER, lease_seconds=30).claim

    with pytest.raises(NotClaimOwner):
        fence.settle_claim(claim, ClaimState.DONE, actor="worker-b/2", reference="pi_x")
    fence.settle_claim(claim, ClaimState.FAILED, actor=WORKER, error="declined")
    before = audit(op)
    with pytest.raises(IllegalTransition):
        fence.settle_claim(claim, ClaimState.DONE, actor=WORKER, reference="pi_y")

    row = StepClaim.objects.get(pk=claim.pk)
    assert (row.state, row.provider_reference) == (ClaimState.FAILED, "")
    assert audit(op) == before


def test_release_held_lease__one_round_trip__and_none_once_the_lease_is_lost(queue):
    op = fence.acquire_lease(pending_checkout().pk, owner=WORKER, seconds=30).operation

    lost = fence.release_held_lease(op, OperationState.SUCCEEDED, owner="worker-b/2")
    with counting() as counter:
        released = fence.release_held_lease(
            op, OperationState.SUCCEEDED, owner=WORKER, reason="all steps done", last_error=""
        )

    assert lost is None
    assert released is not None and trips(counter).total == 1
    op.refresh_from_db()
    assert (op.state, op.lease_owner, op.lease_expires_at) == (OperationState.SUCCEEDED, "", None)
    assert audit(op)[-1] == ("", OperationState.RUNNING, OperationState.SUCCEEDED, WORKER)


#: BEGIN (alone on Django's backend, with the order's read on the opt-in one), the order's
#: read (its key and earlier-charge checks), the operation with its audit row and job id,
#: the order's status, COMMIT.
CHECKOUT_REQUEST_TRIPS = {STOCK: 5, BEGIN_WITH_FIRST_STATEMENT: 4}


def test_checkout_request__one_transaction__its_round_trips(queue, backend):
    order = create_order(amount=1500, currency="eur", email="api@example.com")

    with counting() as counter:
        op, created = request_checkout(
            order_id=order.pk, key="api-1", payment_method="pm_card_visa", actor="api"
        )

    counted = trips(counter)
    assert created and counted.commits == 1 and counted.begins == 1
    assert counted.total == CHECKOUT_REQUEST_TRIPS[backend], counted
    op.refresh_from_db()
    assert op.job_id and op.dispatched_at is not None
    assert audit(op) == [("", "", OperationState.PENDING, "api")]
    assert queue.fetch_job(op.job_id) is not None


def trips_by_job_of_one_checkout(queue, key: str) -> dict[str, RoundTrips]:
    """Run one fenced checkout and its follow-ups on the bench's counting worker; return
    the round trips of each job function (the two follow-ups add up)."""
    from devtools.bench import dbcount
    from devtools.bench.dbcount import recorded
    from devtools.bench.workers import CountingWorker
    from tests.support.flows import checkout

    op = checkout(key)
    CountingWorker.counter = dbcount.RoundTripCounter()
    CountingWorker.counter.install()
    try:
        CountingWorker([queue], connection=queue.connection).work(burst=True)
    finally:
        CountingWorker.counter.uninstall()
        CountingWorker.counter = None
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    return {name.rsplit(".", 1)[-1]: t for name, t in recorded(queue.connection).items()}


def worker_trips_of_one_checkout(queue, key: str) -> RoundTrips:
    """One fenced checkout's round trips on the worker side, its three jobs added up."""
    return sum(trips_by_job_of_one_checkout(queue, key).values(), RoundTrips())


def test_fenced_checkout__at_most_five_transactions_on_the_worker_side(provider, queue):
    """Lease with the charge's claim, then one transaction per stretch between two calls,
    two follow-ups.

    The charge's outcome, the invoice and the e-mail's claim commit together
    (before the e-mail goes); the e-mail's outcome, mark_paid with its
    follow-ups and the lease's release commit together.
    """
    counted = worker_trips_of_one_checkout(queue, "six-1")

    assert counted.jobs == 3
    assert counted.transactions <= 5, counted


def worker_trips_by_job(queue, key: str, monkeypatch) -> tuple[dict[str, int], dict]:
    """One fenced checkout's round trips by job function, without what a kept
    connection pays once (the Parse of a prepared statement, the health check); and
    every count by job function (jobs run included), for the assertion's message."""
    monkeypatch.setattr("payments.engine.worker.HEALTH_CHECK_AFTER_IDLE", 60.0)
    by_job = trips_by_job_of_one_checkout(queue, key)
    return {name: t.total - t.prepares - t.health_checks for name, t in by_job.items()}, by_job


#: By job function, on each backend. The checkout job: the lease with the order's read
#: and the charge's claim (1: the claim built from the job's hint of the operation,
#: payments.engine.runtime._first_claim); the invoice, then the charge's outcome, the invoice's
#: claim with its result and the e-mail's claim with the COMMIT (2); the order's status,
#: the e-mail's outcome with the two follow-ups (one pipeline), mark_paid's claim with
#: its result and the release with the COMMIT (3); and each of its two transactions'
#: BEGIN in a round trip of its own on Django's backend (+2), not on the opt-in one,
#: which sends it with the transaction's first statement.
#: The follow-ups (two jobs, added up): the inbox row with the `succeeded` (one
#: statement), COMMIT (2 each), their writes: the ledger line (1), the day's counter
#: made or added to (1); and each one's BEGIN alone on Django's backend (+2).
JOB_TRIPS = {
    STOCK: {"run_operation": 8, "deliver_message": 8},
    BEGIN_WITH_FIRST_STATEMENT: {"run_operation": 6, "deliver_message": 6},
}


def test_fenced_checkout__round_trips_of_each_job(provider, queue, monkeypatch, backend):
    """A local step costs no round trip beside its writes: it runs first, then its claim
    with its result goes in front of the unit's next fence statement; so does a call's
    outcome. The statement a unit commits with sends the COMMIT in its own round trip
    (a pipeline). See JOB_TRIPS for the count of each."""
    by_job, counted = worker_trips_by_job(queue, "trips-1", monkeypatch)

    assert by_job == JOB_TRIPS[backend], counted
