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
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from payments.desk.views import nothing_ran
from payments.desk.views.nothing_ran import failed_before_running_not_listed
from payments.desk.views.queries import follow_up_q
from payments.engine.fence import GAVE_UP_BEFORE_RUNNING
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


@pytest.fixture
def outage_in_history(history: int) -> int:
    """Every failed operation of the history failed before anything ran (its claim gave up):
    the cases' list, the count of those not listed and the look for older ones find rows."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE payments_stepclaim SET error = %s WHERE state = 'failed'",
            [f"{GAVE_UP_BEFORE_RUNNING}every try refused before it ran"],
        )
        cursor.execute("ANALYZE payments_stepclaim")
    return history


def test_needs_attention_after_an_outage__counts_what_it_does_not_list_in_bounds(
    outage_in_history, as_on_a_large_table, senior, queue, monkeypatch
):
    monkeypatch.setattr(nothing_ran, "FAILED_BEFORE_RUNNING_MOST", 1)  # a full list: counted
    client = client_for(senior)

    def open_page() -> None:
        response = client.get(reverse("admin:payments_operation_needs_attention"))
        assert response.context["not_listed"].older

    read = history_read_by(statements_sent(open_page), PER_OPERATION * outage_in_history)
    assert read == [], "\n".join(read)


def test_older_cases_and_the_filter__read_from_the_claims_that_gave_up_only(
    history, as_on_a_large_table, senior
):
    """None failed before running among a year's failures (declines): the look for an older
    case, and the operations list's filter, read the claims that gave up (none), not every
    failed operation nor every claim (a review measured 110-170 ms at a million)."""
    business = Operation.objects.exclude(follow_up_q())
    client = client_for(senior)

    def look() -> None:
        assert not failed_before_running_not_listed(business, timezone.now(), listed=0).older
        listed = client.get(reverse("admin:payments_operation_changelist"), {"nothing_ran": "yes"})
        assert listed.status_code == 200 and listed.context["cl"].result_count == 0

    read = history_read_by(statements_sent(look), PER_OPERATION)
    assert read == [], "\n".join(read)
    assert Operation.objects.filter(state=OperationState.FAILED).count() > PER_OPERATION * 5


def test_follow_ups_not_succeeded__the_list_reads_the_open_and_failed_rows_only(history, senior):
    """Needs attention's "N not succeeded" link, with half the history made of follow-ups
    (a year of ledger lines before they ran inline): the list and its count read the
    unfinished and failed rows through their partial indexes, not the succeeded ones."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE payments_operation SET kind = 'record_sale' WHERE id % 2 = 0")
        cursor.execute("ANALYZE payments_operation")
    client = client_for(senior)
    url = client.get(reverse("admin:payments_operation_needs_attention")).context["follow_ups_url"]
    open_follow_ups = (
        Operation.objects.filter(follow_up_q()).exclude(state=OperationState.SUCCEEDED).count()
    )

    def open_list() -> None:
        listed = client.get(url)
        assert listed.context["cl"].result_count == open_follow_ups > 0

    with planner_sees_larger(FENCE_TABLES):
        read = history_read_by(statements_sent(open_list), PER_OPERATION * history)
    assert read == [], "\n".join(read)
