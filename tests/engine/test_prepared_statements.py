"""The fence's statements are prepared once per connection, except behind a transaction pooler.

Each test looks at PostgreSQL's own list of the session's prepared
statements (pg_prepared_statements) after real transitions.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from django.db import close_old_connections, connection, transaction

from devtools.bench.dbcount import counting
from payments.engine import driver, fence
from payments.models import Operation, OperationState
from tests.support.concurrency import on_another_connection
from tests.support.flows import checkout

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "worker-a/1"


def prepared_on_this_session() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def lease_and_back(op: Operation) -> None:
    fence.acquire_lease(op.pk, owner=WORKER, seconds=30)
    fence.release_held_lease(op, OperationState.RETRYING, owner=WORKER, reason="again")


def test_a_transition__is_parsed_once_per_connection(queue):
    op = checkout("prep-1")
    connection.close()  # a new session: nothing prepared yet

    with counting() as first:
        lease_and_back(op)
    with counting() as second:
        lease_and_back(op)

    assert (first.snapshot().prepares, second.snapshot().prepares) == (2, 0)
    assert second.snapshot().total == 2  # one round trip per transition, no Parse
    statements = prepared_on_this_session()
    assert any("lease_expires_at = statement_timestamp()" in s for s in statements)


def test_behind_a_transaction_pooler__nothing_is_prepared(queue, monkeypatch):
    """DATABASE_POOLING=transaction pins OPTIONS prepare_threshold to None: a prepared
    statement would not follow the client to its next PgBouncer server session."""
    op = checkout("prep-2")
    options = {**connection.settings_dict.get("OPTIONS", {}), "prepare_threshold": None}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    connection.close()

    with counting() as counter:
        lease_and_back(op)

    assert counter.snapshot().prepares == 0
    assert prepared_on_this_session() == []
    op.refresh_from_db()
    assert op.state == OperationState.RETRYING


def alter_from_another_connection(sql: str) -> None:
    """What `migrate` in another process does (psycopg forgets its statements after an
    ALTER on its own connection, so the test must not run it on this one)."""

    def run() -> None:
        with connection.cursor() as cursor:
            cursor.execute(sql)

    on_another_connection(run)


def test_a_column_added_by_a_migration__does_not_break_a_prepared_statement(queue):
    """A deploy migrates while workers keep their connections: the statements name
    their columns, so the prepared result does not change ("cached plan must not
    change result type" would fail every transition until the worker reconnects)."""
    op = checkout("prep-3")
    lease_and_back(op)  # prepared on this session
    alter_from_another_connection(
        "ALTER TABLE payments_operation ADD COLUMN added_by_a_deploy integer"
    )
    try:
        lease_and_back(op)
        leased = fence.acquire_lease(op.pk, owner=WORKER, seconds=30)
    finally:
        alter_from_another_connection(
            "ALTER TABLE payments_operation DROP COLUMN added_by_a_deploy"
        )
    assert leased.acquired and leased.operation.state == OperationState.RUNNING


# --- from an outside review: when the fence must not prepare, and the health check ------


def kill_this_backend() -> None:
    """The server ends this session (a PostgreSQL or PgBouncer restart), unknown to Django."""
    pid = connection.connection.info.backend_pid
    alter_from_another_connection(f"SELECT pg_terminate_backend({pid})")


def test_a_kept_connection_that_broke__is_replaced_before_the_first_fence_statement(queue):
    """A job's first statement is acquire_lease: Django's health check must run before it,
    as before any ORM query, or a worker fails its first job after a restart."""
    op = checkout("prep-4")
    connection.close_at = time.monotonic() + 60  # kept (CONN_MAX_AGE), not expired
    kill_this_backend()
    close_old_connections()  # a job's start: the next cursor runs the health check

    leased = fence.acquire_lease(op.pk, owner=WORKER, seconds=30)

    assert leased.acquired


def test_with_server_side_binding__the_orms_queries_are_not_prepared(queue, monkeypatch):
    op = checkout("prep-5")
    options = {**connection.settings_dict.get("OPTIONS", {}), "server_side_binding": True}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    connection.close()

    lease_and_back(op)
    for i in range(3):
        list(Operation.objects.filter(key=f"nope-{i}"))

    assert prepared_on_this_session() == []


def test_with_queries_logged__the_fence_statements_are_logged_with_their_values(queue):
    op = checkout("prep-6")
    connection.force_debug_cursor = True
    try:
        connection.queries_log.clear()
        lease_and_back(op)
        logged = [query["sql"] for query in connection.queries]
    finally:
        connection.force_debug_cursor = False

    assert len(logged) == 2
    assert "'worker-a/1'" in logged[0] and "make_interval(secs => 30)" in logged[0]


def test_prepared_statements_rows__read_in_djangos_time_zone_as_the_orms_are(queue, settings):
    """Django switches a cursor's timestamptz loader when its time zone changes on an
    open connection (USE_TZ, TIME_ZONE overridden); the fence's own cursors do the same:
    a lease read back says the same instant as the ORM."""
    op = checkout("prep-tz")
    connection.ensure_connection()  # open before the change, as in a test run
    settings.USE_TZ = False
    settings.TIME_ZONE = "Asia/Kolkata"
    try:
        leased = fence.acquire_lease(op.pk, owner=WORKER, seconds=30).operation
        by_the_orm = Operation.objects.get(pk=op.pk)
        assert leased.updated_at == by_the_orm.updated_at
        assert leased.updated_at.tzinfo is None
    finally:
        connection.close()  # the next test's connection in the default time zone


def test_transitions__reuse_their_connections_psycopg_cursors(queue, monkeypatch):
    """A new psycopg cursor looks up its loaders and dumpers again: the fence keeps its
    cursors on the connection, as many as one round trip needs, and reads every row
    before the next statement."""
    op = checkout("prep-reuse")
    connection.close()
    made: list[object] = []
    original = psycopg.Cursor.__init__

    def counting(self: psycopg.Cursor, *args: object, **kwargs: object) -> None:
        if type(self) is psycopg.Cursor:  # the fence's (Django's own are its subclasses)
            made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "__init__", counting)
    for _ in range(5):
        lease_and_back(op)
    leased = fence.acquire_lease(op.pk, owner=WORKER, seconds=30).operation

    assert len(made) == 1  # ten transitions, one statement at a time, one cursor
    assert leased.state == OperationState.RUNNING and leased.lease_owner == WORKER


OPERATION_BY_ID = (
    "SELECT id, key, scope, tenant, kind, entity_type, entity_id, params, fingerprint, "
    "state, attempts, last_error, next_attempt_at, lease_owner, lease_expires_at, job_id, "
    "dispatched_at, result, retry_of_id, parent_id, created_at, updated_at, purged_at "
    "FROM payments_operation WHERE id = %(id)s"
)
ORDER_BY_ID = (
    "SELECT id, amount, currency, status, customer_email, refunded_amount, created_at, "
    "updated_at FROM payments_order WHERE id = %(id)s"
)


def test_a_receiver_running_fence_statements_while_rows_become_instances__reads_right(queue):
    """Making an instance runs the model's post_init receivers; one that runs fence
    statements of its own (on the kept cursors) finds every row of the outer call read:
    the lease still comes with its order."""
    from django.db.models.signals import post_init

    from payments.shop.models import Order

    op = checkout("prep-nested")
    other = checkout("prep-nested-other")
    nested: list[object] = []

    def read_another(sender: type, instance: Operation, **kwargs: object) -> None:
        if nested:
            return
        nested.append(instance)
        fence._rows_of(  # two statements: the kept cursors 0 and 1
            [
                (Operation, OPERATION_BY_ID, {"id": other.pk}),
                (Order, ORDER_BY_ID, {"id": -1}),
            ]
        )

    post_init.connect(read_another, sender=Operation)
    try:
        leased = fence.acquire_lease(op.pk, owner=WORKER, seconds=30, entities=(Order,))
    finally:
        post_init.disconnect(read_another, sender=Operation)

    assert nested
    assert leased.acquired
    assert leased.entities[Order] is not None
    assert leased.entities[Order].pk == int(op.entity_id)


def test_a_round_trip_wider_than_the_kept_cursors__gets_cursors_of_its_own(queue):
    op = checkout("prep-wide")
    fence.acquire_lease(op.pk, owner=WORKER, seconds=30)  # a kept cursor or more
    wide = driver.KEEP_CURSORS + 3

    rows = fence._rows(
        Operation,
        [(OPERATION_BY_ID, {"id": op.pk})] * wide,
    )

    assert [row.pk for row in rows] == [op.pk] * wide
    kept = getattr(connection.connection, driver._KEPT_CURSORS)[1]
    assert len(kept) <= driver.KEEP_CURSORS


def plans_of(fragment: str) -> tuple[int, int]:
    """(generic, custom) plans PostgreSQL made for this session's statement holding it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE strpos(statement, %s) > 0",
            [fragment],
        )
        return cursor.fetchone()


def plan_cache_mode() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW plan_cache_mode")
        return cursor.fetchone()[0]


LEASE = "lease_expires_at = statement_timestamp()"


def test_a_new_connection__plans_each_fence_statement_once__never_at_each_call(queue):
    """PostgreSQL's default plans a prepared statement again at every execution while its
    generic plan looks costlier (the fence's CTEs do): each new connection is set to
    generic plans with its set-up, so the lease is never planned for its values, and
    the transitions' round trips count no SET."""
    op = checkout("prep-generic")
    connection.close()

    with counting() as first:
        lease_and_back(op)
    for _ in range(3):
        lease_and_back(op)

    assert plan_cache_mode() == "force_generic_plan"
    generic, custom = plans_of(LEASE)
    assert (generic >= 4, custom) == (True, 0)
    assert (first.snapshot().total, first.snapshot().prepares) == (4, 2)  # 2 Parses, 2 runs


def test_a_connection_opened_inside_a_transaction__is_set_before_its_begin(queue):
    """Django opens a connection before the atomic block's BEGIN: the SET runs in
    autocommit, so a rollback of the first transaction cannot undo it."""
    op = checkout("prep-generic-tx")
    connection.close()

    with pytest.raises(RuntimeError), transaction.atomic():
        fence.acquire_lease(op.pk, owner=WORKER, seconds=30)
        raise RuntimeError("rolled back")

    assert plan_cache_mode() == "force_generic_plan"


def test_behind_a_transaction_pooler__the_session_keeps_its_plan_setting(queue, monkeypatch):
    """PgBouncer in transaction pooling hands the session to other clients: no SET there."""
    op = checkout("prep-generic-pool")
    options = {**connection.settings_dict.get("OPTIONS", {}), "prepare_threshold": None}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    connection.close()

    lease_and_back(op)

    assert plan_cache_mode() == "auto"


def test_generic_plans_off__the_session_keeps_postgresqls_default(queue, settings):
    """PAYMENTS["GENERIC_PLANS"] = False, for a project whose own prepared statements or
    PL/pgSQL functions need plans made for their values."""
    settings.PAYMENTS = {**settings.PAYMENTS, "GENERIC_PLANS": False}
    connection.close()

    connection.ensure_connection()

    assert plan_cache_mode() == "auto"


def test_a_set_the_server_refuses__leaves_the_connection_usable_and_says_so(
    queue, monkeypatch, caplog
):
    """The receiver never fails a connection: a refused SET (here, an unknown setting's
    name, as an older server would answer) is logged and the session keeps its default."""
    monkeypatch.setattr(
        driver.psycopg.Connection, "execute", _refusing_set(driver.psycopg.Connection.execute)
    )
    connection.close()

    connection.ensure_connection()

    assert plan_cache_mode() == "auto"
    assert "keep PostgreSQL's plan cache mode" in caplog.text


def _refusing_set(execute):
    def refusing(self, query, *args, **kwargs):
        if str(query).startswith("SET plan_cache_mode"):
            return execute(self, "SET plan_cache_moode = force_generic_plan")
        return execute(self, query, *args, **kwargs)

    return refusing
