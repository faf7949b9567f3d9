"""The app behind PgBouncer in transaction pooling: web, workers and recovery, one session.

PgBouncer runs with one server connection (`default_pool_size = 1`): every
transaction of every process (gunicorn's workers, `rqworker`, `run_recovery`)
runs, one after the other, on the same PostgreSQL session. Session state one
client left behind (a prepared statement, a WITH HOLD cursor, a LISTEN, a
session advisory lock) would be there for the next client to trip over, and is
read from that session at the end. Two controls show the pooler really shares
it: psycopg's prepared statements collide across two clients, and Django's
server-side cursors do leave a cursor in the session, unless DATABASE_POOLING
is set.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine.failpoints import AFTER_PROVIDER_ACCEPT
from payments.models import (
    ClaimState,
)
from tests.support.flows import assert_paid_once
from tests.support.topology import (
    Api,
    all_settled,
    checkout_settled,
    free_port,
    start_gunicorn,
    stop_process,
)
from tests.support.workers import ROOT, Supervisor, wait_until, worker_env

# Transactional: the processes behind PgBouncer must see (and write) committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

SESSION_STATE = {
    "prepared statements": "SELECT count(*) FROM pg_prepared_statements",
    "open cursors": "SELECT count(*) FROM pg_cursors",
    "LISTEN channels": "SELECT count(*) FROM pg_listening_channels()",
    # Any session's advisory locks on this database (a session lock outlives its transaction).
    "advisory locks": "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    "temporary tables": "SELECT count(*) FROM pg_class WHERE relpersistence = 't'",
}


def database_name() -> str:
    return str(connection.settings_dict["NAME"])


def pooled_env(provider_url: str, bouncer, **extra: str) -> dict[str, str]:
    """A process of the app whose DATABASE_URL is PgBouncer, in transaction pooling mode."""
    return worker_env(
        provider_url,
        DATABASE_URL=bouncer.url(database_name()),
        DATABASE_POOLING="transaction",
        DB_CONN_MAX_AGE="60",  # kept connections: PgBouncer client slots, health-checked
        **extra,
    )


def test_checkout_through_pgbouncer__paid_once_on_one_shared_session_left_clean(
    provider, queue, pgbouncer, tmp_path
):
    with pgbouncer.connect(database_name()) as probe:
        (session,) = probe.execute("SELECT pg_backend_pid()").fetchone()
    env = pooled_env(provider.url, pgbouncer)
    port = free_port()
    web = start_gunicorn(env, port, tmp_path / "web.log")
    supervisor = Supervisor(env, "pgbouncer")  # an rqworker and run_recovery
    clients_seen = 0
    try:
        api = Api(port, settings.API_TOKEN)
        orders = {}
        for index in range(3):
            order_id, key = api.checkout(f"pooled-{index}")
            orders[key] = order_id

        def settled() -> bool:
            nonlocal clients_seen
            supervisor.poll()
            pool = pgbouncer.pool(database_name())
            clients_seen = max(clients_seen, pool["cl_active"] + pool["cl_waiting"])
            # 3 checkouts and their follow-ups (ledger line, sales counter)
            return all_settled(9)

        wait_until(settled, timeout=60, what="every operation to succeed through PgBouncer")
    finally:
        stderr = supervisor.stop()
        stop_process(web)

    assert supervisor.restarts == 0, stderr
    assert_paid_once(provider, orders)
    # Web workers, the rqworker and the recovery loop were clients at once, on one session.
    assert clients_seen >= 3
    assert sum(row["database"] == database_name() for row in pgbouncer.admin("SHOW SERVERS")) == 1
    # Many transactions from those clients, all on that session.
    time.sleep(1.5)  # PgBouncer refreshes its counters each second (stats_period)
    stats = pgbouncer.stats(database_name())
    transactions, queries = stats["total_xact_count"], stats["total_query_count"]
    assert transactions > 50
    with pgbouncer.connect(database_name()) as probe:
        assert probe.execute("SELECT pg_backend_pid()").fetchone() == (session,)
        left = {name: probe.execute(sql).fetchone()[0] for name, sql in SESSION_STATE.items()}
    assert left == dict.fromkeys(SESSION_STATE, 0)
    print(f"\n{clients_seen} clients, {transactions} transactions ({queries} queries), 1 session")


def test_crash_after_provider_accept_through_pgbouncer__redelivery_charges_once(
    provider, queue, pgbouncer, tmp_path
):
    """tests/crash's SIGKILL of a worker between the provider's 200 and its record."""
    order = create_order(amount=2500, currency="eur", email="crash@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="pooled-crash", payment_method="pm_card_visa", actor="test"
    )
    marker = tmp_path / "failpoint"
    env = pooled_env(
        provider.url,
        pgbouncer,
        FENCE_FAILPOINTS=AFTER_PROVIDER_ACCEPT,
        FENCE_FAILPOINT_MARKER=str(marker),
    )
    supervisor = Supervisor(env, "pooled-crash")  # restarts the killed rqworker; run_recovery

    def succeeded() -> bool:
        return checkout_settled(op)

    stderr = supervisor.run_until(
        succeeded, timeout=40, what="the checkout and its follow-ups to succeed"
    )

    assert marker.with_name(f"failpoint.{AFTER_PROVIDER_ACCEPT}").exists(), stderr
    assert supervisor.restarts >= 1
    assert_paid_once(provider, {op.key: order.pk})
    assert set(op.claims.values_list("step", "state")) == {
        ("charge", ClaimState.DONE),
        ("invoice", ClaimState.DONE),
        ("confirmation_email", ClaimState.DONE),
        ("mark_paid", ClaimState.DONE),
    }


def test_control__pooled_clients_share_a_session_so_prepared_statements_collide(pgbouncer):
    """What DATABASE_POOLING=transaction keeps off breaks behind this very pooler."""
    with (
        pgbouncer.connect(database_name(), prepare_threshold=0) as first,
        pgbouncer.connect(database_name(), prepare_threshold=0) as second,
    ):
        first.execute("SELECT 1 + %s", [1])  # psycopg prepares it in the shared session
        with pytest.raises(psycopg.errors.DuplicatePreparedStatement):
            second.execute("SELECT 1 + %s", [1])


ITERATE = """
from django.db import connection
from payments.checkout.orders import create_order
from payments.shop.models import Order
for _ in range(3):
    create_order(amount=100, currency="eur", email="cursor@example.com")
cursors = []
for _ in Order.objects.order_by("pk").iterator(chunk_size=1):
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_cursors")
        cursors.append(cursor.fetchone()[0])
print(max(cursors))
"""


@pytest.mark.parametrize(
    ("pooling", "cursors"), [("transaction", 0), ("", 1)], ids=["transaction", "unset"]
)
def test_iterator_through_pgbouncer__keeps_no_cursor_in_the_session_when_pooling(
    provider, pgbouncer, pooling, cursors
):
    """QuerySet.iterator() (the desk's CSV export) in a real process behind PgBouncer."""
    env = worker_env(
        provider.url, DATABASE_URL=pgbouncer.url(database_name()), DATABASE_POOLING=pooling
    )
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", ITERATE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # Without the setting Django declares a WITH HOLD cursor that lives in the session.
    assert int(done.stdout.strip().splitlines()[-1]) == cursors
