"""What a call's statements read of the fence's tables, from their plans under EXPLAIN ANALYZE.

The plan tests write a few thousand operations (tests.support.history), show
the planner the tables a thousand times larger (`planner_sees_larger`),
record the SELECTs a call sends and run each again under EXPLAIN ANALYZE: a
sequential scan of operations, claims or audit rows, or a scan node that
reads more than `bound` rows summed over its loops, is history read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connection

from tests.support.history import FENCE_TABLES

Statement = tuple[str, Any]


def statements_sent(call: Callable[[], object]) -> list[Statement]:
    """The SELECTs `call` sent, with their parameters."""
    sent: list[Statement] = []

    def record(execute, sql, params, many, context):
        if sql.lstrip().upper().startswith("SELECT"):
            sent.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        call()
    return sent


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def history_read(
    sql: str, params: Any, bound: int, tables: tuple[str, ...] = FENCE_TABLES
) -> list[str]:
    """What the statement read of `tables` beyond `bound` rows, or by a sequential scan."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        raw = cursor.fetchone()[0]
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    found = []
    for node in _nodes(plan):
        table = node.get("Relation Name")
        if table not in tables:
            continue
        read = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
        if node["Node Type"] == "Seq Scan" or read > bound:
            found.append(f"{node['Node Type']} on {table} ({read} rows): {' '.join(sql.split())}")
    return found


def history_read_by(statements: list[Statement], bound: int) -> list[str]:
    """`history_read` of every statement, in one list."""
    return [found for sql, params in statements for found in history_read(sql, params, bound)]
