"""A job on FenceWorker sends its metric counts in RQ's own end-of-job pipeline.

A fenced checkout counts a provider call and its operation's new state (HINCRBY
in the queue's Redis): each was a Redis round trip of its own, which the
unfenced twin does not pay. On FenceWorker they are held while the job runs and
added to the pipeline RQ sends at the job's end (payments.engine.counters);
the scrape reads the same figures. Outside a worker's job they go at once.
"""

from __future__ import annotations

from typing import Any

import pytest
from redis.client import Pipeline, Redis

from payments.engine import counters
from payments.observability.metrics import COUNTER_PREFIX, increment
from payments.testing import run_jobs
from tests.support.flows import order_and_checkout

pytestmark = pytest.mark.django_db(transaction=True)

CALLS = COUNTER_PREFIX + "payments_provider_calls_total"
CHANGES = COUNTER_PREFIX + "payments_operation_transitions_total"


class Sent:
    """The counter HINCRBYs sent on their own, and those sent inside a pipeline."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.alone: list[tuple[Any, ...]] = []
        self.piped: list[tuple[Any, ...]] = []
        self.transactions: list[list[tuple[Any, ...]]] = []
        alone, piped = Redis.execute_command, Pipeline.execute

        def execute_command(client: Any, *args: Any, **options: Any) -> Any:
            if _counted(args):
                self.alone.append(args)
            return alone(client, *args, **options)

        def execute(pipeline: Any, *args: Any, **options: Any) -> Any:
            stack = [c[0] for c in pipeline.command_stack]
            self.piped += [a for a in stack if _counted(a)]
            if pipeline.transaction:
                self.transactions.append(stack)
            return piped(pipeline, *args, **options)

        monkeypatch.setattr(Redis, "execute_command", execute_command)
        monkeypatch.setattr(Pipeline, "execute", execute)


def _counted(args: tuple[Any, ...]) -> bool:
    return bool(args) and args[0] == "HINCRBY" and str(args[1]).startswith(COUNTER_PREFIX)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    return Sent(monkeypatch)


def test_a_checkout_on_fence_worker__its_counts_ride_rqs_end_of_job_pipeline(
    provider, queue, redis_conn, sent, settings
):
    """The real path: a checkout's job on FenceWorker (payments.testing.run_jobs), its
    follow-ups inline as in production (one job)."""
    settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": True}
    order_and_checkout()
    run_jobs(queue)

    assert sent.alone == []
    assert sorted(a[1] for a in sent.piped) == sorted([CALLS, CHANGES])
    # In the MULTI RQ sends with the job's status and the worker's own count.
    [with_job] = [t for t in sent.transactions if any(_counted(a) for a in t)]
    assert ("HINCRBY", f"rq:worker:{_worker_name(with_job)}", "successful_job_count", 1) in [
        tuple(a) for a in with_job
    ]
    assert redis_conn.hget(CALLS, "checkout|charge|success") == b"1"
    assert redis_conn.hget(CHANGES, "checkout|succeeded") == b"1"


def test_a_job_that_fails__its_counts_ride_rqs_failure_pipeline(provider, queue, redis_conn, sent):
    """The charge answered 500 once: a transient failure, its job retried by RQ."""
    provider.state.enqueue_faults("fail_before", 1)
    order_and_checkout()
    run_jobs(queue)

    assert sent.alone == []
    assert redis_conn.hget(CALLS, "checkout|charge|transient") == b"1"
    assert redis_conn.hget(CALLS, "checkout|charge|success") == b"1"
    assert redis_conn.hget(CHANGES, "checkout|retrying") == b"1"
    assert redis_conn.hget(CHANGES, "checkout|succeeded") == b"1"


def test_a_worker_on_another_redis__its_counts_sent_after_the_job_in_one_round_trip(
    provider, queue, redis_conn, sent, monkeypatch
):
    monkeypatch.setattr(counters, "same_redis", lambda one, other: False)
    order_and_checkout()
    run_jobs(queue)

    assert sent.alone == []
    assert redis_conn.hget(CALLS, "checkout|charge|success") == b"1"
    assert redis_conn.hget(CHANGES, "checkout|succeeded") == b"1"
    assert not any(_counted(a) for t in sent.transactions for a in t)


def test_outside_a_job__a_count_goes_at_once(redis_conn, sent):
    increment("payments_provider_calls_total", "checkout|charge|success")
    assert len(sent.alone) == 1 and sent.piped == []
    assert redis_conn.hget(CALLS, "checkout|charge|success") == b"1"


def _worker_name(commands: list[tuple[Any, ...]]) -> str:
    for args in commands:
        if args[0] == "HINCRBY" and str(args[1]).startswith("rq:worker:"):
            return str(args[1]).removeprefix("rq:worker:")
    raise AssertionError("no worker count in the pipeline")
