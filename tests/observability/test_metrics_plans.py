"""A scrape of /metrics reads the unfinished rows, never the history.

Prometheus scrapes every 30 s for as long as the service runs: each of the
scrape's statements must read the unfinished rows through the partial
indexes of migration 0014, however long the history (the finished ones are
counted as they finish, in Redis). A few thousand operations, shown to the
planner as a thousand times more, as tests/engine/test_recovery_plans.py
does; every SELECT the scrape sends is run again under EXPLAIN ANALYZE.
"""

from __future__ import annotations

import pytest

from payments.models import Operation, OperationState
from tests.support.history import FENCE_TABLES, planner_sees_larger, write_history
from tests.support.plans import history_read_by, statements_sent

# Committed and flushed (TRUNCATE) rather than rolled back: a few thousand rows rolled
# back stay in the tables as dead tuples, and the size they leave skews the plans of
# the plan tests that run after this one.
pytestmark = pytest.mark.django_db(transaction=True)

COUNT = 3000
#: Rows a scan may read per operation that is not succeeded (its claims, its audit rows).
PER_OPERATION = 4
TOKEN = "metrics-token-for-plans-0123456789"


def test_scrape__reads_only_unfinished_rows(client, settings, queue):
    settings.METRICS_TOKEN = TOKEN
    write_history(COUNT, open_every=500, failed_every=50)
    not_succeeded = Operation.objects.exclude(state=OperationState.SUCCEEDED).count()

    def scrape() -> None:
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert response.status_code == 200
        assert b'payments_metrics_source_up{source="database"} 1.0' in response.content

    with planner_sees_larger(FENCE_TABLES):
        statements = statements_sent(scrape)
        bound = PER_OPERATION * not_succeeded
        read = history_read_by(statements, bound)

    assert len(statements) >= 3
    assert read == [], "\n".join(read)
    assert bound < COUNT / 5  # the bound is far below a walk of the history
