"""The desk's pages with many operations: server time of the list, Needs attention, a payment.

The rows are bulk-inserted in SQL (one statement per table, in the bench's
own database, which the bench empties anyway): orders, their checkout
operations in a mix of states, a charge claim each and the audit rows a
run leaves. The pages are then asked through Django's test client in this
process: the time measured is the server's (URL resolution, the admin's
view, its queries, the template), without a network or a browser.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection, transaction
from django.test import Client

from devtools.bench.webload import percentile

#: Out of every 20 operations: what a busy day leaves (most paid, a few to work).
STATE_MIX = (["succeeded"] * 15) + ["failed", "failed", "uncertain", "needs_review", "retrying"]
PERMISSIONS = ("view_operation", "view_order", "view_invoice", "reconcile_operation")

SEED_ORDERS = """
INSERT INTO payments_order (amount, currency, status, customer_email, refunded_amount,
                            request_fingerprint, created_at, updated_at)
SELECT 1000 + g %% 9000, 'eur', 'paid', 'bench-' || g || '@example.com', 0, '',
       now() - g * interval '7 seconds', now() - g * interval '7 seconds'
FROM generate_series(1, %(n)s) AS g
"""
SEED_OPERATIONS = """
INSERT INTO payments_operation (key, scope, kind, entity_type, entity_id, params, fingerprint,
                                state, attempts, last_error, lease_owner, job_id,
                                created_at, updated_at)
SELECT 'desk-bench-' || o.id, 'client', 'checkout', 'order', o.id::text,
       jsonb_build_object('order_id', o.id, 'amount', o.amount, 'currency', 'eur',
                          'payment_method', 'pm_card_visa'),
       md5(o.id::text), (%(mix)s::text[])[1 + o.id %% %(mix_len)s], 1,
       CASE WHEN o.id %% %(mix_len)s >= 15 THEN 'UncertainProviderError: no complete answer'
            ELSE '' END, '', '', o.created_at, o.updated_at
FROM payments_order AS o
"""
SEED_CLAIMS = """
INSERT INTO payments_stepclaim (operation_id, step, state, idempotency_key, provider_reference,
                                error, attempts, requests_sent, claimed_by, claimed_at,
                                updated_at)
SELECT op.id, 'charge',
       CASE op.state WHEN 'succeeded' THEN 'done' WHEN 'failed' THEN 'failed'
                     ELSE 'uncertain' END,
       'fence_' || md5('desk-bench' || op.id), 'pi_bench' || op.id, '',
       1 + op.id %% 4, 0, 'bench-worker', op.created_at, op.updated_at
FROM payments_operation AS op
"""
SEED_EVENTS = """
INSERT INTO payments_operationevent (operation_id, step, from_state, to_state, actor, reason,
                                     created_at)
SELECT op.id, '', '', 'pending', 'api', 'created', op.created_at FROM payments_operation AS op
UNION ALL
SELECT op.id, 'charge', 'claimed', c.state, 'bench-worker', '', op.updated_at
FROM payments_operation AS op JOIN payments_stepclaim AS c ON c.operation_id = op.id
UNION ALL
SELECT op.id, '', 'running', op.state, 'bench-worker', '', op.updated_at
FROM payments_operation AS op
"""


def seed(n: int) -> None:
    """Insert `n` orders with a checkout each, its charge claim and its audit rows."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(SEED_ORDERS, {"n": n})
        cursor.execute(SEED_OPERATIONS, {"mix": STATE_MIX, "mix_len": len(STATE_MIX)})
        cursor.execute(SEED_CLAIMS, {})  # with parameters: its %% is a modulo
        cursor.execute(SEED_EVENTS)
        cursor.execute("ANALYZE payments_order, payments_operation, payments_stepclaim")


def _operator() -> Any:
    user, _ = get_user_model().objects.get_or_create(
        username="bench-operator", defaults={"is_staff": True}
    )
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label__in=("payments", "shop"), codename__in=PERMISSIONS
        )
    )
    return user


def _timed(client: Client, url: str) -> float:
    started = time.perf_counter()
    response = client.get(url)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}")
    return elapsed * 1000


def desk_pages(n: int, samples: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Seed `n` operations, then time each desk page `samples` times: p50/p95 in ms."""
    say(f"desk pages: seeding {n:,} operations...")
    seed(n)
    client = Client()
    client.force_login(_operator())
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM payments_order")
        order_ids = [row[0] for row in cursor.fetchall()]
    rng = random.Random(31)
    pages: dict[str, Callable[[], str]] = {
        "operations list": lambda: "/admin/payments/operation/",
        "operations list, show all": lambda: "/admin/payments/operation/?all=&followups=all",
        "needs attention": lambda: "/admin/payments/operation/needs-attention/",
        "payment page": lambda: f"/admin/shop/order/{rng.choice(order_ids)}/change/",
    }
    figures: dict[str, Any] = {"operations": n, "samples": samples}
    for name, url in pages.items():
        say(f"desk pages: {name} x{samples}...")
        _timed(client, url())  # the first load fills caches (templates, content types)
        times = [_timed(client, url()) for _ in range(samples)]
        figures[name] = {
            "p50_ms": statistics.median(times),
            "p95_ms": percentile(times, 95),
        }
    return figures


def desk_rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    """The desk's lines of the bench's table."""
    rows = []
    for name, times in f.items():
        if isinstance(times, dict):
            label = f"desk: {name} ({f['operations']:,} operations)"
            rows.append((label, f"p50 {times['p50_ms']:.0f} ms, p95 {times['p95_ms']:.0f} ms"))
    return rows
