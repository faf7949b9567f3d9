"""The recovery loop's periodic queries read the unfinished rows, never the history.

A few thousand operations, almost all finished, as a year of history would
be. On tables this small a sequential scan, or a merge join along a whole
primary key, is often the cheapest plan; so the planner is shown the tables
a thousand times larger than they are (their and their indexes' row counts
in pg_class, scaled inside the test's transaction: the fractions ANALYZE
measured stay). Each query is then run under EXPLAIN ANALYZE: no sequential
scan of operations, claims or audit rows, and no scan node of those tables
reads more than a few rows (PER_OPERATION) for each unfinished or failed
operation, summed over its loops (an index over every row, walked whole,
would read the history).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.db import connection

from payments.engine import fence
from payments.engine.handlers import unknown_recorded_names
from payments.engine.recovery import (
    claims_to_reconcile,
    due_operations,
    stranded_operations,
    sweep,
)
from payments.engine.writes import fence_writes
from payments.models import ClaimState, Operation, OperationState, StepClaim
from tests.support.history import FENCE_TABLES, planner_sees_larger, write_history
from tests.support.plans import history_read_by, statements_sent

pytestmark = pytest.mark.django_db

COUNT = 3000
#: Rows a scan may read per unfinished or failed operation (its claims, over a nested loop's
#: iterations): which plan the planner picks for them depends on statistics earlier tests left.
PER_OPERATION = 4
#: Tables thirty times larger: a history of about 90,000 operations, whose done claims a
#: hash still holds in PostgreSQL's default work_mem (`make bench-history` met it from
#: 10,000 to 300,000 operations); at a thousand times a hash would not fit.
HASHABLE_SCALE = 30


@pytest.fixture
def history() -> int:
    """COUNT operations; returns how many are not succeeded (unfinished or failed)."""
    write_history(COUNT, open_every=500, failed_every=50)
    return Operation.objects.exclude(state=OperationState.SUCCEEDED).count()


@pytest.fixture
def as_on_a_large_table() -> Iterator[None]:
    with planner_sees_larger(FENCE_TABLES):
        yield


def test_history__the_recovery_queries_read_only_unfinished_rows(
    history, as_on_a_large_table, queue
):
    now = fence.db_now()
    querysets = [
        Operation.objects.filter(due_operations(now)).order_by("id")[:500],
        StepClaim.objects.filter(claims_to_reconcile())
        .select_related("operation")
        .order_by("claimed_at", "id")[:200],
        Operation.objects.filter(stranded_operations())[:200],
    ]
    statements = [qs.query.sql_with_params() for qs in querysets]
    statements += statements_sent(lambda: sweep(dry_run=True))
    statements += statements_sent(unknown_recorded_names)
    assert len(statements) >= 6
    bound = PER_OPERATION * history
    read = history_read_by(statements, bound)
    assert read == [], "\n".join(read)
    assert bound < COUNT / 5  # the bound is far below a walk of the history


def test_history__the_recovery_queries_still_find_their_rows(history):
    """The partial indexes change how, not what: each query finds the unfinished rows."""
    now = fence.db_now()
    pending = Operation.objects.filter(state=OperationState.PENDING).count()
    assert Operation.objects.filter(due_operations(now)).count() == pending > 0
    uncertain = StepClaim.objects.filter(state="uncertain").count()
    assert StepClaim.objects.filter(claims_to_reconcile()).count() == uncertain > 0
    assert not Operation.objects.filter(stranded_operations()).exists()
    assert unknown_recorded_names() == []


@pytest.mark.parametrize("scale", [HASHABLE_SCALE, 1000])
def test_declined_history__the_reconcile_command_reads_no_claim_history(scale):
    """Declined checkouts are failed operations, a few in every hundred of a year's.

    Inside one OR with the uncertain arm, the stranded pass's failed arm ran its
    EXISTS hashed: every done claim with a reference read to test them (#39: 4 ms
    at 10,000 operations, 117 ms at 300,000). A statement of its own, it probes
    each failed operation's claims by the unique (operation, step) index.
    """
    write_history(COUNT, open_every=COUNT + 2, failed_every=10)
    with fence_writes():  # hand-made state: a quiet night, nothing left to look at
        StepClaim.objects.filter(state=ClaimState.UNCERTAIN).update(
            state=ClaimState.DONE, provider_reference="pi_quiet"
        )
        Operation.objects.filter(state=OperationState.UNCERTAIN).update(
            state=OperationState.SUCCEEDED
        )
    failed = Operation.objects.filter(state=OperationState.FAILED).count()
    with planner_sees_larger(FENCE_TABLES, scale=scale), connection.cursor() as cursor:
        cursor.execute("SET LOCAL work_mem = '4MB'")  # PostgreSQL's default, as the bench ran
        statements = statements_sent(lambda: call_command("reconcile", stdout=io.StringIO()))
        read = history_read_by(statements, PER_OPERATION * failed)
    assert len(statements) >= 2  # the claims to look at, the stranded operations
    assert read == [], "\n".join(read)
    # The bound is far below a read of the done claims (what the hash read).
    assert PER_OPERATION * failed < StepClaim.objects.filter(state=ClaimState.DONE).count() / 2
