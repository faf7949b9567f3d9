"""A year of history for `make bench-history`: copies of what real checkouts wrote.

A few real checkouts run through the worker against the fake provider first
(`template`); their rows (orders, operations, claims, audit rows, inbox rows,
invoices, ledger lines) are then copied with INSERT ... SELECT, copy `i` with
every id moved by `i` times the template's largest id (so references between
rows stay right), every key, reference and number suffixed with `~i`, and
every time moved back over the span so that times grow with ids as they do
in production (copy 1 the oldest, the last copy a step before the template,
which is today's): the audit finds a day's claims by bisecting the ids. One statement per table per chunk of copies,
each chunk its own transaction; identity sequences are moved past the copies
at the end, and the tables analysed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction

#: The tables copied, in an order that keeps foreign keys satisfied.
COPIED = (
    "payments_order",
    "payments_operation",
    "payments_stepclaim",
    "payments_operationevent",
    "payments_invoice",
    "payments_ledgerentry",
    "inbox_inboxentry",
)

SPANS = """
SELECT (SELECT coalesce(max(id), 0) FROM payments_order),
       (SELECT coalesce(max(id), 0) FROM payments_operation),
       (SELECT coalesce(max(id), 0) FROM payments_stepclaim),
       (SELECT coalesce(max(id), 0) FROM payments_operationevent),
       (SELECT coalesce(max(id), 0) FROM payments_invoice),
       (SELECT coalesce(max(id), 0) FROM payments_ledgerentry),
       (SELECT coalesce(max(id), 0) FROM inbox_inboxentry),
       (SELECT count(*) FROM payments_operation)
"""

COPY_ORDERS = """
INSERT INTO payments_order (id, amount, currency, status, customer_email, created_at, updated_at,
                            refunded_amount, client_id, idempotency_key, request_fingerprint)
OVERRIDING SYSTEM VALUE
SELECT o.id + i * %(orders)s, o.amount, o.currency, o.status,
       'buyer' || (o.id + i * %(orders)s) || '@example.com',
       o.created_at - (%(spread)s + 1 - i) * %(step)s::interval, o.updated_at - (%(spread)s + 1 - i) * %(step)s::interval, o.refunded_amount, o.client_id,
       CASE WHEN o.idempotency_key IS NULL THEN NULL ELSE o.idempotency_key || '~' || i END,
       o.request_fingerprint
FROM payments_order AS o CROSS JOIN generate_series(%(first)s, %(last)s) AS i
WHERE o.id <= %(orders)s
"""

COPY_OPERATIONS = """
INSERT INTO payments_operation (id, key, scope, tenant, kind, entity_type, entity_id, params,
                                fingerprint, state, attempts, last_error, next_attempt_at,
                                lease_owner, lease_expires_at, job_id, dispatched_at, result,
                                retry_of_id, parent_id, created_at, updated_at)
OVERRIDING SYSTEM VALUE
SELECT op.id + i * %(operations)s, op.key || '~' || i, op.scope, op.tenant, op.kind,
       op.entity_type,
       CASE WHEN op.entity_type = 'order' THEN (op.entity_id::bigint + i * %(orders)s)::text
            ELSE op.entity_id || '~' || i END,
       op.params, op.fingerprint, op.state, op.attempts, op.last_error,
       op.next_attempt_at - (%(spread)s + 1 - i) * %(step)s::interval, op.lease_owner, op.lease_expires_at - (%(spread)s + 1 - i) * %(step)s::interval,
       op.job_id, op.dispatched_at - (%(spread)s + 1 - i) * %(step)s::interval, op.result,
       op.retry_of_id + i * %(operations)s, op.parent_id + i * %(operations)s,
       op.created_at - (%(spread)s + 1 - i) * %(step)s::interval, op.updated_at - (%(spread)s + 1 - i) * %(step)s::interval
FROM payments_operation AS op CROSS JOIN generate_series(%(first)s, %(last)s) AS i
WHERE op.id <= %(operations)s
"""

COPY_CLAIMS = """
INSERT INTO payments_stepclaim (id, operation_id, step, state, idempotency_key,
                                provider_reference, request, result, error, provider_view,
                                attempts, claimed_by, claimed_at, last_request_at,
                                lease_expires_at, settled_at, updated_at)
OVERRIDING SYSTEM VALUE
SELECT c.id + i * %(claims)s, c.operation_id + i * %(operations)s, c.step, c.state,
       c.idempotency_key || '~' || i,
       CASE WHEN c.provider_reference = '' THEN '' ELSE c.provider_reference || '_' || i END,
       c.request, c.result, c.error, c.provider_view, c.attempts, c.claimed_by,
       c.claimed_at - (%(spread)s + 1 - i) * %(step)s::interval, c.last_request_at - (%(spread)s + 1 - i) * %(step)s::interval,
       c.lease_expires_at - (%(spread)s + 1 - i) * %(step)s::interval, c.settled_at - (%(spread)s + 1 - i) * %(step)s::interval, c.updated_at - (%(spread)s + 1 - i) * %(step)s::interval
FROM payments_stepclaim AS c CROSS JOIN generate_series(%(first)s, %(last)s) AS i
WHERE c.id <= %(claims)s
"""

COPY_EVENTS = """
INSERT INTO payments_operationevent (id, operation_id, step, from_state, to_state, actor, reason,
                                     created_at)
OVERRIDING SYSTEM VALUE
SELECT e.id + i * %(events)s, e.operation_id + i * %(operations)s, e.step, e.from_state,
       e.to_state, e.actor, e.reason, e.created_at - (%(spread)s + 1 - i) * %(step)s::interval
FROM payments_operationevent AS e CROSS JOIN generate_series(%(first)s, %(last)s) AS i
WHERE e.id <= %(events)s
"""

COPY_INVOICES = """
INSERT INTO payments_invoice (id, number, amount, currency, provider_reference, created_at,
                              order_id)
OVERRIDING SYSTEM VALUE
SELECT v.id + i * %(invoices)s, v.number || '~' || i, v.amount, v.currency,
       v.provider_reference || '_' || i, v.created_at - (%(spread)s + 1 - i) * %(step)s::interval, v.order_id + i * %(orders)s
FROM payments_invoice AS v CROSS JOIN generate_series(%(first)s, %(last)s) AS i
WHERE v.id <= %(invoices)s
"""

COPY_LEDGER = """
INSERT INTO payments_ledgerentry (id, amount, currency, provider_reference, created_at, order_id)
OVERRIDING SYSTEM VALUE
SELECT l.id + i * %(ledger)s, l.amount, l.currency, l.provider_reference || '_' || i,
       l.created_at - (%(spread)s + 1 - i) * %(step)s::interval, l.order_id + i * %(orders)s
FROM payments_ledgerentry AS l CROSS JOIN generate_series(%(first)s, %(last)s) AS i
WHERE l.id <= %(ledger)s
"""

COPY_INBOX = """
INSERT INTO inbox_inboxentry (id, consumer, message_id, handled_at)
OVERRIDING SYSTEM VALUE
SELECT b.id + i * %(inbox)s, b.consumer, b.message_id || '~' || i, b.handled_at - (%(spread)s + 1 - i) * %(step)s::interval
FROM inbox_inboxentry AS b CROSS JOIN generate_series(%(first)s, %(last)s) AS i
WHERE b.id <= %(inbox)s
"""

COPIES = (
    COPY_ORDERS,
    COPY_OPERATIONS,
    COPY_CLAIMS,
    COPY_EVENTS,
    COPY_INVOICES,
    COPY_LEDGER,
    COPY_INBOX,
)


@dataclass(frozen=True)
class Template:
    """The largest id of each table's template rows, and how many operations they are."""

    orders: int
    operations: int
    claims: int
    events: int
    invoices: int
    ledger: int
    inbox: int
    operation_count: int

    @classmethod
    def read(cls) -> Template:
        with connection.cursor() as cursor:
            cursor.execute(SPANS)
            return cls(*cursor.fetchone())


def first_free_copy(template: Template) -> int:
    """The first copy whose ids are all free: past every row written since the template
    (earlier copies, and the checkouts a bench ran beside them)."""
    now = Template.read()
    spans = ("orders", "operations", "claims", "events", "invoices", "ledger", "inbox")
    return max(1, *(-(-getattr(now, name) // max(1, getattr(template, name))) for name in spans))


def copies_for(template: Template, operations: int) -> int:
    """How many copies of the template make about `operations` operations in all."""
    return max(0, -(-operations // max(1, template.operation_count)) - 1)


def load(
    template: Template,
    copies: int,
    *,
    first: int = 1,
    span_days: float = 400.0,
    spread_over: int | None = None,
    chunk: int = 2000,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Add copies `first` .. `copies` of the template, copy `i` moved `spread_over + 1 - i`
    steps back.

    A step is `span_days` over `spread_over` copies (default `copies`): loading
    in two stages with the same `spread_over` gives one evenly spread history.
    """
    if copies < first:
        return
    step_seconds = span_days * 86400 / (spread_over or copies)
    base = {
        "orders": template.orders,
        "operations": template.operations,
        "claims": template.claims,
        "events": template.events,
        "invoices": template.invoices,
        "ledger": template.ledger,
        "inbox": template.inbox,
    }
    per_chunk = max(1, chunk // max(1, template.operation_count))
    for start in range(first, copies + 1, per_chunk):
        last = min(copies, start + per_chunk - 1)
        params: dict[str, Any] = {
            **base,
            "first": start,
            "last": last,
            "spread": spread_over or copies,
            "step": _interval(step_seconds),
        }
        with transaction.atomic(), connection.cursor() as cursor:
            for statement in COPIES:
                cursor.execute(statement, params)
        if progress is not None:
            progress(last, copies)
    finish()


def _interval(seconds: float) -> str:
    return f"{seconds:.6f} seconds"


def finish() -> None:
    """Move every identity sequence past the copied ids; refresh the planner's statistics."""
    with connection.cursor() as cursor:
        for table in COPIED:
            cursor.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                f"(SELECT coalesce(max(id), 0) + 1 FROM {table}), false)"
            )
        cursor.execute(f"ANALYZE {', '.join(COPIED)}")
