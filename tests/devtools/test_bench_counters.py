"""The bench's database round-trip counter agrees with a libpq protocol trace.

A round trip ends with PostgreSQL's ReadyForQuery: the trace counts those, the
counter counts statements, BEGIN, COMMIT, ROLLBACK and health checks from
Django and psycopg. A fenced checkout run by the bench's counting worker (in
this process) must give the same number both ways, on Django's backend and on the
opt-in project.postgresql (`backend`). No timing is asserted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from django.db import close_old_connections, connection, transaction
from django.db.backends.signals import connection_created
from psycopg import pq

from devtools.bench import dbcount
from devtools.bench.dbcount import RoundTrips, counting, recorded
from devtools.bench.workers import CountingWorker
from payments.engine.dispatch import DELIVER_MESSAGE, RUN_OPERATION
from payments.models import Operation, OperationState
from payments.shop.models import Order
from tests.conftest import BEGIN_WITH_FIRST_STATEMENT, STOCK
from tests.support.flows import checkout

# `backend` first: `trace` follows this thread's connection as the test finds it.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("backend")]

#: The pipelines of test_counter__equals_the_trace_on_a_pipeline_that_fails: the unit's
#: last statement with its COMMIT; on the opt-in backend also its first with its BEGIN.
FAILING_PIPELINE_SYNCS = {STOCK: 1, BEGIN_WITH_FIRST_STATEMENT: 2}

_READY = re.compile(r"^B\t\d+\tReadyForQuery\b", re.MULTILINE)


class Trace:
    """libpq's protocol trace of this thread's connection (re-armed on a reconnect)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: list[tuple[Any, IO[str], Path]] = []
        self.reconnects = 0

    def arm(self) -> None:
        raw = connection.connection
        path = self.directory / f"trace-{len(self.files)}.txt"
        handle = path.open("w")
        raw.pgconn.trace(handle.fileno())
        raw.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        self.files.append((raw, handle, path))

    def on_connect(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        self.reconnects += 1  # after the connection's setup: setup is not counted either

    def round_trips(self) -> int:
        """Stop tracing and count the ReadyForQuery messages written."""
        count = 0
        for raw, handle, path in self.files:
            if not raw.closed:
                raw.pgconn.untrace()  # flushes libpq's buffer
            handle.close()
            count += len(_READY.findall(path.read_text()))
        self.files = []
        return count


@pytest.fixture
def trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Trace]:
    """A fresh connection kept for the whole test (no reconnect between trace and counter)."""
    connection.close()
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", None)
    connection.ensure_connection()
    tracer = Trace(tmp_path)
    connection_created.connect(tracer.on_connect)
    yield tracer
    connection_created.disconnect(tracer.on_connect)
    tracer.round_trips()
    if CountingWorker.counter is not None:
        CountingWorker.counter.uninstall()
        CountingWorker.counter = None
    if CountingWorker.redis_counter is not None:
        CountingWorker.redis_counter.uninstall()
        CountingWorker.redis_counter = None


def test_counter__equals_the_trace_on_begin_commit_rollback_savepoints_and_health_check(trace):
    order = Order.objects.create(amount=100, currency="eur", customer_email="a@example.com")
    trace.arm()
    with counting() as counter:
        close_old_connections()  # a request or job boundary: the next use runs a health check
        Order.objects.filter(pk=order.pk).update(amount=101)  # autocommit: no BEGIN
        with transaction.atomic():
            pass  # nothing sent: no BEGIN, no COMMIT
        with transaction.atomic():
            Order.objects.select_for_update().get(pk=order.pk)
            with transaction.atomic():  # SAVEPOINT ... RELEASE
                Order.objects.filter(pk=order.pk).update(amount=102)
        with pytest.raises(RuntimeError), transaction.atomic():
            Order.objects.filter(pk=order.pk).update(amount=103)
            raise RuntimeError("rolled back")
    counts = counter.snapshot()
    assert trace.round_trips() == counts.total
    assert (counts.begins, counts.commits, counts.rollbacks) == (2, 1, 1)
    assert (counts.savepoints, counts.health_checks, counts.connects) == (2, 1, 0)


@pytest.mark.parametrize("failing", ["statement", "commit"])
def test_counter__equals_the_trace_on_a_pipeline_that_fails(backend, trace, failing):
    """A unit's last statement and its COMMIT in one pipeline, failing in the statement
    (no such step column value) or in the COMMIT (a deferred foreign key): one Sync, then
    the rollback, and psycopg's DEALLOCATE ALL when statements were prepared. (On the
    opt-in backend the unit's first statement went with its BEGIN: the other Sync.)"""
    from django.db import DatabaseError

    from payments.engine import fence
    from payments.engine.unit import WorkUnit

    order = Order.objects.create(amount=100, currency="eur", customer_email="a@example.com")
    op = checkout("count-2")
    target = op if failing == "statement" else Operation(pk=2_000_000_000, key="ghost")
    step = "s" * 100 if failing == "statement" else "s"  # longer than the column: refused
    trace.arm()
    with counting() as counter:
        unit = WorkUnit()
        unit.join()
        Order.objects.filter(pk=order.pk).update(amount=101)
        with pytest.raises(DatabaseError):
            unit.commit_with(
                lambda: fence.claim_step_in_tx(
                    target, step, owner="t", lease_seconds=30, provider_call=False
                )
            )
    counts = counter.snapshot()
    assert trace.round_trips() == counts.total
    assert counts.syncs == FAILING_PIPELINE_SYNCS[backend] and not connection.in_atomic_block


def test_counting_worker__a_fenced_checkout_counted_as_the_trace_counts_it(
    provider, queue, trace, monkeypatch
):
    monkeypatch.setattr("payments.engine.worker.HEALTH_CHECK_AFTER_IDLE", 0.0)  # every job checks
    trace.arm()
    with counting() as api:
        close_old_connections()
        op = checkout("count-1")
    assert trace.round_trips() == api.snapshot().total > 0

    whole_run = _counted_burst(queue, trace)
    assert trace.reconnects == 0 and whole_run.connects == 0

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    by_job = recorded(queue.connection)
    assert set(by_job) == {RUN_OPERATION, DELIVER_MESSAGE}
    assert (by_job[RUN_OPERATION].jobs, by_job[DELIVER_MESSAGE].jobs) == (1, 2)
    jobs = sum(by_job.values(), RoundTrips())
    # Only the worker's start-up check (names recorded on unfinished operations) is outside a job.
    assert 0 < jobs.total <= whole_run.total
    assert jobs.commits >= 3 and jobs.health_checks == 3
    assert Operation.objects.filter(parent=op).count() == 2


def test_counting_worker__a_checkout_with_inline_follow_ups__counted_as_the_trace_counts_it(
    provider, queue, trace, settings
):
    """The ledger line and the sales counter run in mark_paid's transaction, in a
    savepoint that goes with the ledger line's INSERT and is never released
    (payments.engine.driver.savepoints_with_next_statement): one SAVEPOINT sent, in a
    pipeline, no RELEASE; the counter sees it where psycopg sends it, as the trace does."""
    settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": True}
    op = checkout("count-inline")
    _counted_burst(queue, trace)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    by_job = recorded(queue.connection)
    assert set(by_job) == {RUN_OPERATION}
    assert by_job[RUN_OPERATION].savepoints == 1  # SAVEPOINT and RELEASE, each its own, before
    assert by_job[RUN_OPERATION].pipelined > by_job[RUN_OPERATION].syncs
    assert not Operation.objects.filter(parent=op).exists()


def _counted_burst(queue: Any, trace: Trace) -> RoundTrips:
    """Run the queued jobs on the bench's counting worker, traced; check that the counter
    and the trace agree on the whole run's round trips, and return the counter's."""
    trace.arm()
    CountingWorker.counter = dbcount.RoundTripCounter()
    CountingWorker.counter.install()
    CountingWorker([queue], connection=queue.connection).work(burst=True)
    whole_run = CountingWorker.counter.snapshot()
    assert trace.round_trips() == whole_run.total
    return whole_run


def test_redis_counter__a_command_alone_and_a_pipeline_are_one_round_trip_each(redis_conn):
    counter = dbcount.RedisRoundTripCounter()
    counter.install()
    try:
        redis_conn.set("bench-count", 1)
        with redis_conn.pipeline() as pipe:
            pipe.incr("bench-count").incr("bench-count").execute()
        with redis_conn.pipeline() as empty:
            empty.execute()  # nothing queued: nothing sent
        with redis_conn.pipeline() as watching:
            watching.watch("bench-count")  # sent at once while watching
            watching.get("bench-count")
            watching.multi()
            watching.incr("bench-count")
            watching.execute()
    finally:
        counter.uninstall()
    assert counter.trips == 1 + 1 + 0 + 3
    assert redis_conn.get("bench-count") == b"4"


def test_counting_worker__a_fenced_checkout_costs_redis_the_twins_and_its_two_counts(
    provider, queue, trace, settings
):
    """The checkout's job on the bench's counting worker (FenceWorker), follow-ups inline as
    in production, against the unfenced twin's job: the same RQ round trips, and the
    fence's two metric counts (its provider call, its operation's new state), each sent
    as it is made (tests/observability/test_counts_sent_at_once.py says why)."""
    from devtools.bench.jobs import unfenced_checkout

    settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": True}
    checkout("count-redis")
    order = Order.objects.create(amount=2500, currency="eur", customer_email="t@example.com")
    queue.enqueue(unfenced_checkout, order.pk, "pm_card_visa")
    _counted_burst(queue, trace)

    by_job = recorded(queue.connection)
    fenced, twin = by_job[RUN_OPERATION], by_job["devtools.bench.jobs.unfenced_checkout"]
    assert (fenced.jobs, twin.jobs) == (1, 1)
    assert fenced.redis == twin.redis + 2 and twin.redis > 0
