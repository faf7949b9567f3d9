"""The fence's tables carry only the indexes its queries use (payments migration 0010).

Every index gets an entry on each insert and on each update of an indexed
column: each state change of an operation or a claim. What a fenced checkout
writes is counted from PostgreSQL's own write-ahead log (pg_walinspect: one
record per index entry), for the index entries of this database only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from payments.models import Operation, StepClaim
from tests.support.flows import checkout
from tests.support.workers import run_fence_worker

pytestmark = pytest.mark.django_db(transaction=True)

FENCE_TABLES = ("payments_operation", "payments_stepclaim", "payments_operationevent")

#: Index entries one fenced checkout writes (claims, operations, audit rows, inbox rows,
#: the business rows), worker side, counted below: 136 before payments migration 0010,
#: 91 before 0025.
MOST_INDEX_ENTRIES_PER_CHECKOUT = 84


def _indexes(tables: tuple[str, ...]) -> list[tuple[str, str, list[str], list[str], bool, bool]]:
    """(table, index, columns, operator classes, unique, partial) of each index of `tables`."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT t.relname, i.relname,
                   ARRAY(SELECT a.attname FROM unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
                         JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum
                         ORDER BY k.n),
                   ARRAY(SELECT o.opcname FROM unnest(x.indclass) WITH ORDINALITY AS c(oid, n)
                         JOIN pg_opclass o ON o.oid = c.oid ORDER BY c.n),
                   x.indisunique, x.indpred IS NOT NULL
            FROM pg_index x
            JOIN pg_class i ON i.oid = x.indexrelid
            JOIN pg_class t ON t.oid = x.indrelid
            WHERE t.relname = ANY(%s)
            """,
            [list(tables)],
        )
        return cursor.fetchall()


def test_no_index_of_the_fence_tables_serves_only_what_another_serves():
    """A non-unique index whose columns begin another index's (with the same operator
    classes), or that indexes the same columns as another, is written for nothing."""
    found = _indexes((*FENCE_TABLES, "inbox_inboxentry"))
    redundant = []
    for table, name, columns, classes, unique, partial in found:
        if unique or partial:
            continue
        for other_table, other, other_columns, other_classes, _, other_partial in found:
            if other_table != table or other == name or other_partial:
                continue
            prefix = other_columns[: len(columns)] == columns
            if (prefix and other_classes[: len(classes)] == classes) or other_columns == columns:
                redundant.append(f"{table}.{name} {columns} (beside {other} {other_columns})")
    assert redundant == []


@pytest.fixture
def no_seq_scans() -> Iterator[None]:
    """Plans as on a large table: the test tables are tiny, a scan would always win."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")
        yield


@pytest.mark.parametrize(
    "lookup, index",
    [
        # webhooks (payments.webhooks.events), the desk's rules: a provider object's claim
        (lambda: StepClaim.objects.filter(provider_reference="pi_1"), "payments_claim_ref_given"),
        # a prefix (bench-history's sample of references) states the index's condition
        (
            lambda: StepClaim.objects.filter(provider_reference__startswith="re_").exclude(
                provider_reference=""
            ),
            "payments_claim_ref_given",
        ),
        # the audits (payments.observability.audit, fence_audit): refunds, charges
        (
            lambda: StepClaim.objects.filter(provider_reference__in=["pi_1", "re_2"]),
            "payments_claim_ref_given",
        ),
        # a long list (an audit window's refunds) states the condition: past 100 items
        # PostgreSQL no longer proves it from the list
        (
            lambda: StepClaim.objects.filter(
                provider_reference__in=[f"re_{n}" for n in range(500)]
            ).exclude(provider_reference=""),
            "payments_claim_ref_given",
        ),
        # the desk's search by reference: what a look saw, the step not settled with it
        (lambda: StepClaim.objects.filter(seen_reference="pi_1"), "payments_claim_seen_ref"),
        # an operation's claims, and the foreign key's check when an operation is deleted
        (
            lambda: StepClaim.objects.filter(operation_id=1),
            "payments_stepclaim_operation_step_uniq",
        ),
        # a tenant's operations (an API client's: the JSON API's GET /api/operations/<key>)
        (
            lambda: Operation.objects.filter(tenant="client:1"),
            "payments_operation_client_scope_key_uniq",
        ),
        # a checkout's follow-ups, a first attempt's retries (the desk)
        (lambda: Operation.objects.filter(parent_id=1), "payments_op_parent"),
        (lambda: Operation.objects.filter(retry_of_id=1), "payments_op_retry_of"),
        # the desk's chart of the last day's outcomes (payments.desk.views.chart)
        (
            lambda: Operation.objects.filter(state="succeeded", updated_at__gte=timezone.now()),
            "payments_op_succeeded",
        ),
    ],
    ids=[
        "reference",
        "reference-prefix",
        "references",
        "references-500",
        "seen-reference",
        "claims",
        "client",
        "parent",
        "retry",
        "succeeded-since",
    ],  # fmt: skip
)
def test_every_lookup_the_product_makes_still_has_its_index(no_seq_scans, lookup, index):
    queryset: QuerySet = lookup()
    assert index in queryset.explain()


def _this_database_oid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT oid FROM pg_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


def _wal_position() -> str:
    """Where the WAL ends now (pg_walinspect reads up to what is flushed)."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        cursor.execute("SELECT pg_current_wal_flush_lsn()")
        return cursor.fetchone()[0]


def _index_entries_since(start: str) -> Counter[str]:
    """Index entries written in this database since WAL position `start`, by index name."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT substring(block_ref from 'rel \\d+/(\\d+)/(\\d+)') AS db,
                   (regexp_match(block_ref, 'rel \\d+/\\d+/(\\d+)'))[1]::oid AS node
            FROM pg_get_wal_records_info(%s, pg_current_wal_flush_lsn())
            WHERE resource_manager = 'Btree'
              AND record_type IN ('INSERT_LEAF', 'INSERT_POST')
              AND block_ref ~ ('rel \\d+/' || %s || '/')
            """,
            [start, str(_this_database_oid())],
        )
        nodes = [node for _, node in cursor.fetchall()]
        cursor.execute(
            "SELECT relfilenode, relname FROM pg_class WHERE relfilenode = ANY(%s)", [nodes]
        )
        names = dict(cursor.fetchall())
    return Counter(names.get(node, f"relfilenode {node}") for node in nodes)


def test_a_fenced_checkout_writes_few_index_entries(provider, queue):
    """A checkout and its two follow-ups run by the FenceWorker: every claim, audit row,
    inbox row and business row written, counted in the WAL (worker side only)."""
    op = checkout("idx-1")
    start = _wal_position()
    run_fence_worker(queue)
    entries = _index_entries_since(start)

    op.refresh_from_db()
    assert op.state == "succeeded" and op.follow_ups.filter(state="succeeded").count() == 2
    for gone in (
        "payments_claim_idem_key",
        "payments_operation_client_id_22ca80a3",
        "payments_stepclaim_operation_id_777da3cd",
        "payments_operationevent_created_at_315b3e80",
        "payments_stepclaim_provider_reference_98bbd9af",
        "payments_claim_reference",
    ):
        assert entries[gone] == 0, entries
    # Neither the checkout nor its follow-ups are retries: nothing in the partial index.
    assert entries["payments_op_retry_of"] == 0, entries
    # Only the charge's claim carries a reference, from its answer on: one entry.
    assert entries["payments_claim_ref_given"] == 1, entries
    assert sum(entries.values()) <= MOST_INDEX_ENTRIES_PER_CHECKOUT, entries
