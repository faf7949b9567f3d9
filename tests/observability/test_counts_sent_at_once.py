"""A metric count goes to Redis when it is made, and a count that fails never fails a job.

Tried and reverted (issue #39): holding a job's counts on FenceWorker and adding them to
RQ's end-of-job pipeline saved a fenced checkout its two HINCRBY round trips, but a
worker killed mid-job then lost the count of a charge it had made, and a HINCRBY that
errors inside RQ's MULTI (a field that is not an integer) failed a job that had
succeeded, which RQ ran again. These guard the behaviour kept.
"""

from __future__ import annotations

import pytest
from rq.job import Job

from payments.engine.failpoints import AFTER_CLAIM_COMMIT, hooked, point_at
from payments.observability.metrics import COUNTER_PREFIX
from payments.testing import run_jobs
from tests.support.flows import order_and_checkout

pytestmark = pytest.mark.django_db(transaction=True)

CALLS = COUNTER_PREFIX + "payments_provider_calls_total"
CHANGES = COUNTER_PREFIX + "payments_operation_transitions_total"


def test_a_charges_count_is_in_redis_before_the_jobs_next_step(
    provider, queue, redis_conn, settings
):
    """On FenceWorker (payments.testing.run_jobs), follow-ups inline as in production: a
    worker killed at the e-mail's claim has counted the charge it made."""
    settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": True}
    seen = []
    with hooked(
        point_at(AFTER_CLAIM_COMMIT, "confirmation_email"),
        lambda: seen.append(redis_conn.hget(CALLS, "checkout|charge|success")),
    ):
        order_and_checkout()
        run_jobs(queue)
    assert seen == [b"1"]


def test_a_counter_redis_refuses__the_job_succeeds_once__the_other_counts_once(
    provider, queue, redis_conn, settings
):
    settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": True}
    redis_conn.hset(CHANGES, "checkout|succeeded", "not-a-number")  # HINCRBY refuses it
    _, op = order_and_checkout()
    op.refresh_from_db()
    run_jobs(queue)

    op.refresh_from_db()
    assert op.state == "succeeded"
    job = Job.fetch(op.job_id, connection=redis_conn)
    assert [r.return_value for r in job.results()] == ["succeeded"]
    assert redis_conn.hget(CALLS, "checkout|charge|success") == b"1"
