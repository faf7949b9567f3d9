"""Every write a fenced checkout makes reaches its rows through an index, whatever the
tables' statistics say.

A table without statistics (new, or emptied with TRUNCATE: a new deployment's
first minute, each bench batch) is planned as ten pages of unknown rows.
PostgreSQL plans a prepared statement's first runs for their values, then
keeps a generic plan while it costs no more; both are planned against those
statistics, and the kept one is not planned again until they change (an
ANALYZE). SETTLE_CLAIM's join to its locked row was planned, both ways, as a
scan of the whole claims table: every settle read every claim until the next
ANALYZE. Here the fence's tables, and the shop's a checkout writes, are emptied
and kept without statistics (autovacuum off for them) for the test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction

from tests.support.flows import checkout
from tests.support.workers import run_fence_worker

pytestmark = pytest.mark.django_db(transaction=True)

#: The fence's tables, and the shop's a checkout writes (their statistics, left by an earlier
#: test or autovacuum, would make a seq scan of a one-page table the right plan).
TABLES = (
    "payments_operation", "payments_stepclaim", "payments_operationevent", "inbox_inboxentry",
    "payments_order", "payments_invoice", "payments_ledgerentry", "payments_salesday",
)  # fmt: skip

#: Statements that only read: the worker's start-up checks look at every operation.
READS = ("SELECT", "SHOW")
_NAMED = re.compile(r"%\((\w+)\)s")


def _reltuples() -> dict[str, float]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, reltuples FROM pg_class WHERE relname = ANY(%s)", [list(TABLES)]
        )
        return dict(cursor.fetchall())


@pytest.fixture
def without_statistics() -> Iterator[None]:
    """The fence's tables emptied (no row count: reltuples -1), autovacuum kept off them."""
    with connection.cursor() as cursor:
        for table in TABLES:
            cursor.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        cursor.execute(f"TRUNCATE {', '.join(TABLES)} CASCADE")
    try:
        assert all(count < 0 for count in _reltuples().values()), _reltuples()
        yield
        assert all(count < 0 for count in _reltuples().values()), "analyzed meanwhile"
    finally:
        with connection.cursor() as cursor:
            for table in TABLES:
                cursor.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")


def _generic(sql: str, params: Any) -> tuple[str, list[Any]]:
    """`sql` with PostgreSQL's $n placeholders for its parameters, and their values."""
    if not isinstance(params, dict):  # the ORM's: %s in order
        values = list(params or [])
        pieces = sql.replace("%%", "\0").split("%s")
        numbered = pieces[0] + "".join(f"${i}{p}" for i, p in enumerate(pieces[1:], 1))
        return numbered.replace("\0", "%"), values
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return _NAMED.sub(number, sql), [params[name] for name in names]


def _plans(sql: str, params: Any) -> list[str]:
    """The statement's plan for its values, and its generic plan (what a prepared
    statement keeps), each as text."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        custom = "\n".join(row[0] for row in cursor.fetchall())
        prepared, values = _generic(sql, params)
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE fence_plan AS {prepared}")
        try:
            placeholders = ", ".join(["%s"] * len(values))
            cursor.execute(f"EXPLAIN EXECUTE fence_plan({placeholders})", values)
            generic = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("DEALLOCATE fence_plan")
    return [custom, generic]


def test_every_write_of_a_fenced_checkout_uses_an_index_on_tables_without_statistics(
    without_statistics, provider, queue
):
    """A checkout and its two follow-ups on the FenceWorker: each data-modifying statement
    it sent, planned again with its own parameters and as a prepared statement's generic
    plan, scans no table of the product."""
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

    fence_statements = [s for s in sent if s[0].lstrip().upper().startswith("WITH")]
    # The lease, the charge's claim and outcome, the claims, the follow-ups' creation,
    # the release, the two deliveries: each one of the fence's statements.
    assert len(fence_statements) >= 8, [" ".join(s.split())[:60] for s, _ in sent]
    scans = []
    for sql, params in sent:
        if sql.strip().upper() in ("BEGIN", "COMMIT"):
            continue
        for plan in _plans(sql, params):
            if "Seq Scan on payments_" in plan or "Seq Scan on inbox_" in plan:
                scans.append(f"{' '.join(sql.split())[:160]}\n{plan}")
    assert scans == [], "\n\n".join(scans)
