"""The operators' lists stay bounded over a long history (payments.desk.lists).

A few thousand operations and orders, shown to the planner a thousand times
larger (as tests/engine/test_recovery_plans.py does). Every statement a
changelist or a routed search sends reads through an index: no sequential
scan of operations, claims, audit rows or orders (but under a LIMIT, which
stops it: the bounded count); no DISTINCT over a table for a filter; no COUNT
of every row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from payments.models import Operation, StepClaim
from tests.support.history import planner_sees_larger, write_history
from tests.support.users import client_for

pytestmark = pytest.mark.django_db

TABLES = (
    "payments_operation",
    "payments_stepclaim",
    "payments_operationevent",
    "payments_order",
)


@pytest.fixture
def history() -> None:
    write_history(3000, open_every=500, failed_every=50)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO payments_order (amount, currency, status, customer_email,
                                        refunded_amount, created_at, updated_at,
                                        request_fingerprint)
            SELECT 1000, 'eur', 'paid', 'buyer' || g || '@example.com', 0, now(), now(), ''
            FROM generate_series(1, 3000) AS g
            """
        )
        cursor.execute("ANALYZE payments_order")


@pytest.fixture
def as_on_a_large_table() -> Iterator[None]:
    with planner_sees_larger(TABLES):
        yield


def _sent(client, url: str) -> list[tuple[str, Any]]:
    sent: list[tuple[str, Any]] = []

    def record(execute, sql, params, many, context):
        if sql.lstrip().upper().startswith("SELECT") and "payments_" in sql:
            sent.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        response = client.get(url)
    assert response.status_code == 200
    return sent


def _scans(sql: str, params: Any) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        raw = cursor.fetchone()[0]
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    # A scan under a Limit stops after that many rows (the bounded count's): not history.
    found, nodes = [], [(plan, False)]
    while nodes:
        node, limited = nodes.pop()
        limited = limited or node["Node Type"] == "Limit"
        nodes.extend((child, limited) for child in node.get("Plans", []))
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in TABLES and not limited:
            found.append(f"Seq Scan on {node['Relation Name']}: {' '.join(sql.split())[:300]}")
    return found


@pytest.mark.parametrize(
    "page, query",
    [
        ("admin:payments_operation_changelist", ""),
        ("admin:payments_operation_changelist", "?state__exact=failed"),
        ("admin:payments_operation_changelist", "?kind=checkout&followups=all"),
        ("admin:payments_operation_changelist", "?q=pi_hist42"),
        ("admin:payments_operation_changelist", "?q=1000042"),
        ("admin:payments_operation_changelist", "?q=Buyer42@Example.com"),
        ("admin:shop_order_changelist", ""),
        ("admin:shop_order_changelist", "?q=buyer42@example.com"),
        ("admin:shop_order_changelist", "?q=42"),
        ("admin:index", ""),
        ("admin:payments_operation_desk_log", ""),
        ("admin:payments_operation_desk_log", "?operator=sam"),
        ("admin:payments_operation_desk_log", "?before=1500"),
    ],
)
def test_operator_pages__read_through_indexes(
    history,
    as_on_a_large_table,
    senior,
    page,
    query,  # noqa: F811
):
    statements = _sent(client_for(senior), reverse(page) + query)
    assert statements
    assert [s for sql, params in statements for s in _scans(sql, params)] == []
    assert not [sql for sql, _ in statements if "DISTINCT" in sql.upper()]


def test_searches__find_by_reference_order_id_and_email(history, senior):
    client = client_for(senior)
    op = Operation.objects.get(key="hist:42")
    reference = StepClaim.objects.get(operation=op).provider_reference
    url = reverse("admin:payments_operation_changelist")

    for term in (reference, op.entity_id):
        page = client.get(url, {"q": term, "followups": "all"})
        assert [o.pk for o in page.context["cl"].result_list] == [op.pk], term
    orders = client.get(reverse("admin:shop_order_changelist"), {"q": "BUYER7@example.com"})
    assert [o.customer_email for o in orders.context["cl"].result_list] == ["buyer7@example.com"]


def test_the_count__is_exact_when_small_and_estimated_past_the_bound(history, senior, monkeypatch):
    from payments.desk import lists

    url = reverse("admin:payments_operation_changelist")
    exact = client_for(senior).get(url, {"state__exact": "failed"}).context["cl"]
    assert exact.result_count == Operation.objects.filter(state="failed").count()
    monkeypatch.setattr(lists, "EXACT_COUNT_UP_TO", 10)
    estimated = client_for(senior).get(url, {"followups": "all"}).context["cl"]
    assert estimated.result_count > 10


@pytest.mark.parametrize(
    "page", ["admin:payments_operation_changelist", "admin:shop_order_changelist"]
)
def test_default_changelists__send_as_many_queries_for_50_rows_as_for_5(senior, page):
    """Each column is read with the page (annotations, a prefetch): none asks per row."""
    client = client_for(senior)
    url = reverse(page) + ("?followups=all" if "operation" in page else "")

    def queries_for(rows: int) -> int:
        with CaptureQueriesContext(connection) as sent:
            response = client.get(url)
        assert len(response.context["cl"].result_list) == rows
        return len(sent)

    write_history(5, tag="few", analyze=False)  # no statistics left for the plan tests
    _orders(5)
    few = queries_for(5)
    write_history(45, tag="more", analyze=False)
    _orders(45)
    assert queries_for(50) == few


def _orders(count: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO payments_order (amount, currency, status, customer_email,
                                        refunded_amount, created_at, updated_at,
                                        request_fingerprint)
            SELECT 1000, 'eur', 'paid', 'buyer' || g || '@example.com', 0, now(), now(), ''
            FROM generate_series(1, %s) AS g
            """,
            [count],
        )


def _seq_scans_anywhere(sql: str, params: Any) -> list[str]:
    """Every sequential scan of a fence table in the plan, even under a LIMIT."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        raw = cursor.fetchone()[0]
    nodes = [(json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]]
    found = []
    while nodes:
        node = nodes.pop()
        nodes.extend(node.get("Plans", []))
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in TABLES:
            found.append(f"Seq Scan on {node['Relation Name']}: {' '.join(sql.split())[:300]}")
    return found


@pytest.mark.parametrize("query", ["", "?operator=sam", "?before=1500"])
def test_desk_log__walks_the_audit_rows_by_their_primary_key_only(
    history, as_on_a_large_table, senior, query
):
    """The audit rows have no index on their actor: a LIMIT would not stop a scan that finds
    no operator's row. The page reads a primary-key range, never the table."""
    statements = _sent(client_for(senior), reverse("admin:payments_operation_desk_log") + query)
    assert any("payments_operationevent" in sql for sql, _ in statements)
    assert [s for sql, params in statements for s in _seq_scans_anywhere(sql, params)] == []
