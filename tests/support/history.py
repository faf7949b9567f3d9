"""A made-up history of finished operations, written in a few statements.

Each operation is a checkout with one `charge` claim and three audit rows,
created `days` back at most, one a `spacing` apart. Most succeed; every
`failed_every`-th failed, every `open_every`-th is still pending (no claim)
or uncertain (its claim uncertain). Rows are written with SQL, as a bulk
loader would: no fence, no provider, no worker; what the plans, the purge and
the audit see is the shape of the rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connection, transaction

OPERATIONS = """
INSERT INTO payments_operation (
    key, scope, kind, entity_type, entity_id, params, fingerprint, state, attempts,
    last_error, lease_owner, job_id, created_at, updated_at, next_attempt_at
)
SELECT %(tag)s || ':' || g, 'derived', 'checkout', 'order', (1000000 + g)::text,
       jsonb_build_object('amount', 1000, 'currency', 'eur'), '',
       CASE WHEN g %% %(open_every)s = 0 THEN 'pending'
            WHEN g %% %(open_every)s = 1 THEN 'uncertain'
            WHEN g %% %(failed_every)s = 2 THEN 'failed'
            ELSE 'succeeded' END,
       1, '', '', '', now() - g * %(spacing)s, now() - g * %(spacing)s, NULL
FROM generate_series(1, %(count)s) AS g
"""

CLAIMS = """
INSERT INTO payments_stepclaim (
    operation_id, step, state, idempotency_key, provider_reference, error, attempts,
    claimed_by, claimed_at, settled_at, updated_at, result
)
SELECT op.id, 'charge',
       CASE op.state WHEN 'succeeded' THEN 'done' WHEN 'failed' THEN 'failed'
                     ELSE 'uncertain' END,
       'idem-' || op.key,
       CASE op.state WHEN 'succeeded' THEN 'pi_' || %(tag)s || op.id ELSE '' END,
       '', 1, 'loader', op.created_at,
       CASE WHEN op.state IN ('succeeded', 'failed') THEN op.created_at END, op.created_at,
       CASE op.state WHEN 'succeeded' THEN jsonb_build_object('amount', 1000, 'currency', 'eur')
       END
FROM payments_operation AS op
WHERE op.key LIKE %(tag)s || ':%%' AND op.state <> 'pending'
"""

EVENTS = """
INSERT INTO payments_operationevent (operation_id, step, from_state, to_state, actor, reason,
                                     created_at)
SELECT op.id, '', s.from_state, s.to_state, 'loader', '', op.created_at
FROM payments_operation AS op
CROSS JOIN (VALUES ('', 'pending'), ('pending', 'running'), ('running', 'done')) AS s(from_state, to_state)
WHERE op.key LIKE %(tag)s || ':%%'
"""


@dataclass(frozen=True)
class History:
    tag: str
    count: int


def write_history(
    count: int,
    *,
    tag: str = "hist",
    spacing: timedelta = timedelta(minutes=1),
    open_every: int = 50,
    failed_every: int = 10,
    analyze: bool = True,
) -> History:
    """Write `count` operations with their claims and audit rows; ANALYZE the tables."""
    params: dict[str, Any] = {
        "tag": tag,
        "count": count,
        "spacing": spacing,
        "open_every": open_every,
        "failed_every": failed_every,
    }
    with connection.cursor() as cursor:
        for sql in (OPERATIONS, CLAIMS, EVENTS):
            cursor.execute(sql, params)
        if analyze:
            cursor.execute(
                "ANALYZE payments_operation, payments_stepclaim, payments_operationevent"
            )
    return History(tag=tag, count=count)


FENCE_TABLES = ("payments_operation", "payments_stepclaim", "payments_operationevent")


@contextmanager
def planner_sees_larger(
    tables: tuple[str, ...] = FENCE_TABLES, scale: int = 1000
) -> Iterator[None]:
    """Inside a transaction, show the planner `tables` (and their indexes) `scale` times
    their row counts: the fractions ANALYZE measured stay, the sizes are a long history's.
    Rolled back at the end (pg_class is transactional)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE pg_class SET reltuples = reltuples * %s
            WHERE oid IN (
                SELECT c.oid FROM pg_class AS c WHERE c.relname = ANY(%s)
                UNION SELECT i.indexrelid FROM pg_index AS i
                JOIN pg_class AS t ON t.oid = i.indrelid WHERE t.relname = ANY(%s)
            )
            """,
            [scale, list(tables), list(tables)],
        )
        yield
