"""The lease's transaction commits without waiting for its WAL to be flushed.

A lease protects nothing on its own: the claim that fences a call commits
synchronously after it, and PostgreSQL flushes its WAL in order, so a durable
claim makes the lease before it durable too. A lease lost with the server's
last unflushed WAL leaves its operation as it was before (no job runs it: the
sweeper sends it again). Its transaction therefore sets `synchronous_commit`
off for itself (`set_config(..., true)`): never for the session, nor for a
caller's transaction it joins, nor when it carries the claim of the run's first
step (INSERT_CLAIM_WITH_LEASE), which must be flushed before the call.
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from payments.engine import fence
from payments.models import OperationState
from tests.support.flows import checkout

pytestmark = pytest.mark.django_db(transaction=True)

SETTING = "SELECT current_setting('synchronous_commit')"


def _setting() -> str:
    with connection.cursor() as cursor:
        cursor.execute(SETTING)
        return cursor.fetchone()[0]


def test_the_lease_statement__its_own_transaction_commits_asynchronously(queue):
    """The worker's lease statement (ACQUIRE_LEASE), as the fence sends it with the reads
    of the entity: one implicit transaction, whose commit is not waited for."""
    op = checkout("lease-commit-1")
    connection.ensure_connection()
    raw = connection.connection
    params = {
        "id": op.pk,
        "owner": "w/1",
        "seconds": 30,
        "from_states": [OperationState.PENDING, OperationState.RETRYING],
        "async_commit": True,
    }
    with raw.pipeline():
        leased = raw.execute(fence.ACQUIRE_LEASE, params)
        inside = raw.execute(SETTING)
    assert leased.fetchone() is not None
    assert inside.fetchone()[0] == "off"
    assert _setting() == "on"  # the session's own setting is untouched


def test_acquire_lease__leaves_the_session_synchronous(queue):
    op = checkout("lease-commit-2")
    leased = fence.acquire_lease(op.pk, owner="w/1", seconds=30)
    assert leased.acquired and _setting() == "on"
    assert not hasattr(leased.operation, "commit_mode")


def test_acquire_lease_in_a_callers_transaction__its_commit_stays_synchronous(queue):
    """Joined to a caller's transaction, the lease must not make that commit asynchronous:
    the caller may write what a guarantee rests on."""
    op = checkout("lease-commit-3")
    with transaction.atomic():
        leased = fence.acquire_lease(op.pk, owner="w/1", seconds=30)
        assert leased.acquired
        assert _setting() == "on"


def test_a_worker_runs_a_checkout__its_lease_with_the_charge_claim_is_synchronous(provider, queue):
    """The real path: a checkout's job on FenceWorker (payments.testing.run_jobs). Its
    lease carries the charge's claim (INSERT_CLAIM_WITH_LEASE, in the same implicit
    transaction), so it goes without async_commit: the claim fences the call and must be
    flushed before it. Every statement after it finds the session's own setting."""
    from payments.testing import run_jobs
    from tests.support.flows import order_and_checkout

    leases: list[tuple[bool, bool]] = []
    claims: list[str] = []
    after: list[str] = []

    def watch(execute, sql, params, many, context):
        if sql is fence.ACQUIRE_LEASE:
            leases.append((params["async_commit"], connection.in_atomic_block))
        elif sql is fence.INSERT_CLAIM_WITH_LEASE:
            claims.append(params["step"])
        elif not connection.connection.pgconn.pipeline_status:  # a pipeline's are read after
            after.append(connection.connection.execute(SETTING).fetchone()[0])
        return execute(sql, params, many, context)

    order_and_checkout()
    with connection.execute_wrapper(watch):
        run_jobs(queue)
    assert leases == [(False, False)] and claims == ["charge"]
    assert after and set(after) == {"on"}


def test_a_lease_with_no_claim_to_carry__is_asynchronous(provider, queue):
    """A job without the operation's hint (enqueued by an older release) takes its lease
    alone, asynchronously, and claims the charge after it."""
    from rq.job import Job

    from payments.engine.dispatch import HINT_META_KEY
    from payments.testing import run_jobs
    from tests.support.flows import order_and_checkout

    leases: list[bool] = []

    def watch(execute, sql, params, many, context):
        if sql is fence.ACQUIRE_LEASE:
            leases.append(params["async_commit"])
        return execute(sql, params, many, context)

    _, op = order_and_checkout()
    op.refresh_from_db()
    job = Job.fetch(op.job_id, connection=queue.connection)
    del job.meta[HINT_META_KEY]
    job.save_meta()
    with connection.execute_wrapper(watch):
        run_jobs(queue)
    op.refresh_from_db()
    assert leases == [True] and op.state == OperationState.SUCCEEDED
