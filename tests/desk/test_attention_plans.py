"""The desk's summary pages read the unfinished rows and a day's, never the history.

Needs attention and the admin's home page are opened by every operator, many
times a day: each of their statements must read what is unfinished (through
the partial indexes of migration 0014), the failed rows, or the last day's
outcomes (the chart), however long the history. A few thousand operations an
hour apart (four months), shown to the planner as a thousand times more, as
tests/engine/test_recovery_plans.py does; every SELECT a page sends is run
again under EXPLAIN ANALYZE (tests.support.plans).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.urls import reverse

from payments.models import Operation, OperationState
from tests.support.history import FENCE_TABLES, planner_sees_larger, write_history
from tests.support.plans import history_read_by, statements_sent
from tests.support.users import client_for

# Committed and flushed (TRUNCATE) rather than rolled back: a few thousand rows rolled
# back stay in the tables as dead tuples, and the size they leave skews the plans of
# the plan tests that run after this one.
pytestmark = pytest.mark.django_db(transaction=True)

COUNT = 3000
#: Rows a scan may read per operation that is not succeeded (its claims and audit rows,
#: over a nested loop's iterations), as in tests/engine/test_recovery_plans.py.
PER_OPERATION = 4


@pytest.fixture
def history() -> int:
    """COUNT operations an hour apart; returns how many are not succeeded."""
    write_history(COUNT, spacing=timedelta(hours=1), open_every=500, failed_every=50)
    return Operation.objects.exclude(state=OperationState.SUCCEEDED).count()


@pytest.fixture
def as_on_a_large_table() -> Iterator[None]:
    with planner_sees_larger(FENCE_TABLES):
        yield


@pytest.mark.parametrize(
    "page", ["admin:payments_operation_needs_attention", "admin:index"]
)  # fmt: skip
def test_summary_pages__read_only_unfinished_failed_and_recent_rows(
    history, as_on_a_large_table, senior, queue, page
):
    client = client_for(senior)

    def open_page() -> None:
        assert client.get(reverse(page)).status_code == 200

    statements = statements_sent(open_page)

    bound = PER_OPERATION * history
    read = history_read_by(statements, bound)
    assert read == [], "\n".join(read)
    assert bound < COUNT / 5  # the bound is far below a walk of the history
