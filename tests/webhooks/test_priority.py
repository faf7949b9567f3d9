"""What settles money already taken goes ahead of new work on the queue, and comes back
as soon as it can.

Under a checkout burst the payments queue holds many new checkouts. A
provider event about a charge that already happened, and the operation that
event (or the reconciler) resumes, must not wait behind all of them: the
customer paid, the order is not marked paid until they run. Both are
enqueued at the front of the queue. An event deferred because a claim's
owner holds its lease comes back when that lease runs out, not only after
its fixed back-off (a worker killed in its call leaves such a lease behind).
"""

from __future__ import annotations

import signal
from datetime import UTC, datetime

import pytest
from rq import SimpleWorker
from rq.registry import ScheduledJobRegistry

from payments.engine import recovery
from payments.models import OperationState
from payments.webhooks.handling import HANDLE_JOB, RETRY_DELAYS
from tests.support.flows import order_and_checkout
from tests.webhooks.test_settling import (
    claimed_by_a_live_worker,
    deliver,
    only_event,
    uncertain_checkout,
)

pytestmark = pytest.mark.django_db(transaction=True)

BACKLOG = 3


def run_one(queue) -> None:
    """Run the job at the front of the queue, and only that one, in this process."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        SimpleWorker([queue], connection=queue.connection).work(burst=True, max_jobs=1)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def queued_checkouts(count: int) -> list[int]:
    """Ask for `count` new checkouts (their jobs queued, not run); return their operation ids."""
    return [order_and_checkout(email=f"burst{i}@example.com")[1].pk for i in range(count)]


def test_a_provider_event_and_the_operation_it_resumes_go_ahead_of_queued_checkouts(
    provider_with_secret, queue
):
    _, op = uncertain_checkout(provider_with_secret, queue)
    backlog = queued_checkouts(BACKLOG)
    assert len(queue.job_ids) == BACKLOG

    deliver(only_event(provider_with_secret, "payment_intent.succeeded"))

    assert len(queue.job_ids) == BACKLOG + 1
    assert queue.fetch_job(queue.job_ids[0]).func_name == HANDLE_JOB
    run_one(queue)  # the event: the claim is settled, the operation resumed
    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    assert queue.fetch_job(queue.job_ids[0]).args == (op.pk,)
    assert [queue.fetch_job(j).args[0] for j in queue.job_ids[1:]] == backlog


def test_an_operation_the_reconciler_resumes_goes_ahead_of_queued_checkouts(
    provider_with_secret, queue
):
    _, op = uncertain_checkout(provider_with_secret, queue)
    backlog = queued_checkouts(BACKLOG)

    recovery.reconcile()

    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    assert queue.fetch_job(queue.job_ids[0]).args == (op.pk,)
    assert [queue.fetch_job(j).args[0] for j in queue.job_ids[1:]] == backlog


def test_an_event_deferred_by_a_lease__comes_back_when_the_lease_runs_out(
    provider_with_secret, queue
):
    op, _ = claimed_by_a_live_worker(provider_with_secret, lease=3)  # its owner died mid-call
    job = queue.fetch_job(queue.job_ids[0])
    assert job.func_name == HANDLE_JOB
    job.retries_left = 2  # deferred a few times already: the next fixed wait is 30 s
    job.save()
    assert RETRY_DELAYS[len(RETRY_DELAYS) - 2] == 30

    run_one(queue)  # busy: the claim's lease is live for about 3 s more

    scheduled = ScheduledJobRegistry(queue=queue).get_scheduled_time(job)
    assert (scheduled - datetime.now(UTC)).total_seconds() <= 5
    op.refresh_from_db()
    assert op.claims.get().state == "claimed"
