"""Every write a fenced checkout makes reaches its rows through an index, whatever the
tables' statistics say.

A table that has no statistics yet (just created, or emptied with TRUNCATE:
a new deployment, a bench batch, a test) is planned as ten pages of unknown
rows. A statement planned then keeps its plan while the table grows: the
fence prepares its statements and a prepared statement's generic plan is not
planned again until an ANALYZE changes the statistics. A settle that found
its claim with a sequential scan read the whole claims table, for every
claim it settled, until autovacuum's next ANALYZE. The tables here are as
the test database leaves them between tests: truncated, without statistics.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from tests.support.flows import checkout
from tests.support.workers import run_fence_worker

pytestmark = pytest.mark.django_db(transaction=True)

#: Statements that only read: the worker's start-up checks look at every operation.
READS = ("SELECT", "SHOW")


def _unanalyzed(table: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE relname = %s", [table])
        return cursor.fetchone()[0] < 0


def test_every_write_of_a_fenced_checkout_uses_an_index_on_tables_without_statistics(
    provider, queue
):
    """A checkout and its two follow-ups on the FenceWorker: each data-modifying statement
    it sent, planned again with its own parameters, scans no table of the product."""
    for table in ("payments_stepclaim", "payments_operation"):
        assert _unanalyzed(table), f"{table} has statistics: the test would not see the hazard"
    sent: list[tuple[str, Any]] = []

    def record(execute, sql, params, many, context):
        if not sql.lstrip().upper().startswith(READS):
            sent.append((sql, params))
        return execute(sql, params, many, context)

    op = checkout("plans-1")
    with connection.execute_wrapper(record):
        run_fence_worker(queue)
    op.refresh_from_db()
    assert op.state == "succeeded" and op.follow_ups.filter(state="succeeded").count() == 2

    scans = []
    with transaction.atomic(), connection.cursor() as cursor:
        for sql, params in sent:
            if sql.strip().upper() in ("BEGIN", "COMMIT"):
                continue
            cursor.execute("EXPLAIN " + sql, params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            if "Seq Scan on payments_" in plan or "Seq Scan on inbox_" in plan:
                scans.append(f"{' '.join(sql.split())[:160]}\n{plan}")
    assert sent, "no statement recorded"
    assert scans == [], "\n\n".join(scans)
