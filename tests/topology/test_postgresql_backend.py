"""project.postgresql: a transaction's BEGIN in the round trip of its first statement.

The opt-in backend (DATABASE_BEGIN_WITH_FIRST_STATEMENT=1): every test here runs
on it (`begin_with_first_statement`), Django's stock backend being the default.

Round trips are counted from libpq's own protocol trace (ReadyForQuery
messages), what the transaction does is checked from a second connection:
the first statement's change stays invisible and its locks held until the
COMMIT, a rollback undoes it, a failing first statement leaves nothing.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import django
import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import (
    DEFAULT_DB_ALIAS,
    IntegrityError,
    ProgrammingError,
    connection,
    connections,
    transaction,
)
from django.db.backends.postgresql.psycopg_any import IsolationLevel
from psycopg import pq

from payments.shop.models import Invoice, Order, OrderStatus
from project.postgresql.base import (
    TESTED_VERSIONS,
    DatabaseWrapper,
    check_tested_versions,
    untested_versions,
)

# transaction=True: the swapped-in connection must not inherit a test's open transaction.
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("begin_with_first_statement"),
]

_READY = re.compile(r"^B\t\d+\tReadyForQuery\b", re.MULTILINE)


def order() -> Order:
    return Order.objects.create(amount=100, currency="eur", customer_email="b@example.com")


@pytest.fixture
def other() -> Iterator[psycopg.Connection]:
    """A second connection to the test database, autocommit: what others see."""
    settings = connection.settings_dict
    conn = psycopg.connect(
        dbname=settings["NAME"], user=settings["USER"], host=settings["HOST"] or None,
        port=settings["PORT"] or None, autocommit=True,
    )  # fmt: skip
    yield conn
    conn.close()


def amount_seen_by(other: psycopg.Connection, pk: int) -> int:
    row = other.execute("SELECT amount FROM payments_order WHERE id = %s", [pk]).fetchone()
    assert row is not None
    return int(row[0])


class Trace:
    """Count this connection's round trips (ReadyForQuery) while armed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Trace:
        connection.ensure_connection()
        self.handle = self.path.open("w")
        connection.connection.pgconn.trace(self.handle.fileno())
        connection.connection.pgconn.set_trace_flags(
            pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE
        )
        return self

    def __exit__(self, *exc: object) -> None:
        connection.connection.pgconn.untrace()
        self.handle.close()
        self.text = self.path.read_text()
        self.round_trips = len(_READY.findall(self.text))


def test_engine__is_this_backend():
    assert isinstance(connections[DEFAULT_DB_ALIAS], DatabaseWrapper)


def test_installed_versions__the_tested_ones():
    """requirements.txt pins what TESTED_VERSIONS names: the backend imported, so they match."""
    assert untested_versions({"Django": django.__version__, "psycopg": psycopg.__version__}) == []


@pytest.mark.parametrize("name", sorted(TESTED_VERSIONS))
def test_another_django_or_psycopg_version__refused_naming_it(name):
    installed = {**TESTED_VERSIONS, name: "99.0"}

    with pytest.raises(ImproperlyConfigured, match=rf"{name} 99\.0 \(tested: "):
        check_tested_versions(installed)


def test_atomic_block__begin_rides_with_the_first_statement__its_change_stays_in_the_transaction(
    tmp_path, other
):
    o = order()
    with Trace(tmp_path / "t") as trace, transaction.atomic():
        Order.objects.filter(pk=o.pk).update(amount=101)
        assert connection.connection.info.transaction_status == pq.TransactionStatus.INTRANS
        assert amount_seen_by(other, o.pk) == 100  # not committed yet
        Order.objects.filter(pk=o.pk).update(amount=102)
    # BEGIN with the first UPDATE, the second UPDATE, COMMIT (Django's stock backend: 4).
    assert trace.round_trips == 3
    sent = [line for line in trace.text.splitlines() if line.startswith("F")]
    assert sum('"BEGIN"' in line for line in sent) == 1
    assert amount_seen_by(other, o.pk) == 102


def test_first_statement_locks__held_until_the_commit(other):
    o = order()
    with transaction.atomic():
        Order.objects.select_for_update().get(pk=o.pk)
        with pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute("SELECT 1 FROM payments_order WHERE id = %s FOR UPDATE NOWAIT", [o.pk])
    other.execute("SELECT 1 FROM payments_order WHERE id = %s FOR UPDATE NOWAIT", [o.pk])


def test_rollback__undoes_the_first_statement(other):
    o = order()
    with pytest.raises(RuntimeError), transaction.atomic():
        Order.objects.filter(pk=o.pk).update(amount=101)
        raise RuntimeError("roll back")
    assert amount_seen_by(other, o.pk) == 100
    assert connection.connection.info.transaction_status == pq.TransactionStatus.IDLE


def test_failing_first_statement__raised_as_django_error__nothing_kept__connection_usable(other):
    o = order()
    Invoice.objects.create(order=o, number="INV-1", amount=1, currency="eur")
    with pytest.raises(IntegrityError), transaction.atomic():
        Invoice.objects.create(order=o, number="INV-1", amount=1, currency="eur")
    with transaction.atomic():
        Order.objects.filter(pk=o.pk).update(status=OrderStatus.PAID)
    assert Invoice.objects.filter(order=o).count() == 1
    o.refresh_from_db()
    assert o.status == OrderStatus.PAID


def test_statement_without_parameters__several_commands__in_the_transaction(tmp_path, other):
    o = order()
    with Trace(tmp_path / "t") as trace:
        with pytest.raises(RuntimeError), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(
                    f"UPDATE payments_order SET amount = 101 WHERE id = {o.pk}; "
                    f"UPDATE payments_order SET amount = 102 WHERE id = {o.pk}"
                )
            assert amount_seen_by(other, o.pk) == 100
            raise RuntimeError("roll back")
    # BEGIN alone (a simple query may hold several commands), the two UPDATEs, ROLLBACK.
    assert trace.round_trips == 3
    assert amount_seen_by(other, o.pk) == 100


def test_statement_with_parameters__several_commands__run_as_with_djangos_backend(tmp_path, other):
    """Django's client-side cursor sends a statement with parameters as a simple query,
    which may hold several commands; in a pipeline (extended protocol) it may not. As a
    transaction's first statement it runs once, in the transaction, as it would with
    Django's own backend."""
    o = order()
    with Trace(tmp_path / "t") as trace:
        with pytest.raises(RuntimeError), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE payments_order SET amount = amount + %s WHERE id = %s; "
                    "UPDATE payments_order SET amount = amount + %s WHERE id = %s",
                    [1, o.pk, 2, o.pk],
                )
                assert cursor.rowcount == 1
            o.refresh_from_db()
            assert o.amount == 103  # each UPDATE once
            assert amount_seen_by(other, o.pk) == 100
            raise RuntimeError("roll back")
    assert amount_seen_by(other, o.pk) == 100
    # The pipeline refused (BEGIN and the statement), ROLLBACK, BEGIN alone, the two
    # UPDATEs in one simple query, the read, ROLLBACK.
    sent = re.findall(r"^F\t\d+\t(?:Query|Parse)\t[^\n]*?(ROLLBACK|BEGIN|UPDATE)", trace.text, re.M)
    assert sent[:4] == ["BEGIN", "UPDATE", "ROLLBACK", "BEGIN"], trace.text
    assert sent.count("UPDATE") == 2, trace.text


def test_syntax_error_raised_while_the_first_statement_ran__not_run_again(other):
    """A 42601 that a function raises at run time (its EXECUTE of bad SQL) comes after the
    statement ran: it is raised as with Django's backend, the statement not sent again
    (a sequence it advanced, which no rollback undoes, advanced once)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMPORARY SEQUENCE fence_test_runs; "
            "CREATE FUNCTION pg_temp.fence_test_run(n int) RETURNS int LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM nextval('fence_test_runs'); EXECUTE 'SELEC 1'; RETURN n; END $$"
        )
    with pytest.raises(ProgrammingError), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_temp.fence_test_run(%s)", [1])
    with connection.cursor() as cursor:
        cursor.execute("SELECT last_value FROM fence_test_runs")
        assert cursor.fetchone()[0] == 1


def test_executemany__in_the_transaction(other):
    o = order()
    with pytest.raises(RuntimeError), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.executemany(
                "UPDATE payments_order SET amount = %s WHERE id = %s", [(101, o.pk), (102, o.pk)]
            )
        assert amount_seen_by(other, o.pk) == 100
        raise RuntimeError("roll back")
    assert amount_seen_by(other, o.pk) == 100


def test_server_side_cursor__declared_in_the_transaction_and_not_holdable(settings):
    o = order()
    with transaction.atomic():
        rows = Order.objects.filter(pk__gte=o.pk).iterator(chunk_size=1)
        assert next(rows).pk == o.pk
        with connection.cursor() as cursor:
            cursor.execute("SELECT is_holdable FROM pg_cursors WHERE name LIKE '_django_curs%%'")
            assert cursor.fetchall() == [(False,)]
        rows.close()
    rows = Order.objects.filter(pk__gte=o.pk).iterator(chunk_size=1)
    assert next(rows).pk == o.pk  # outside a transaction: WITH HOLD, as Django declares it
    rows.close()


def test_isolation_level_from_options__in_the_begin():
    db = DatabaseWrapper(
        {
            **connection.settings_dict,
            "OPTIONS": {
                **connection.settings_dict["OPTIONS"],
                "isolation_level": IsolationLevel.SERIALIZABLE,
            },
        },
        alias="serializable",
    )
    try:
        with _atomic(db):
            with db.cursor() as cursor:
                cursor.execute("SELECT current_setting(%s)", ["transaction_isolation"])
                assert cursor.fetchone() == ("serializable",)
    finally:
        db.close()


class _atomic:
    """transaction.atomic() for a wrapper that is not in django.db.connections."""

    def __init__(self, db: DatabaseWrapper) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.set_autocommit(False)

    def __exit__(self, *exc: object) -> None:
        self.db.rollback()
        self.db.set_autocommit(True)


def test_autocommit_back_on_with_the_transaction_still_open__refused_as_psycopg_does(other):
    """Django's manual transactions: turning autocommit back on before ending the
    transaction is refused (psycopg refuses it with its own autocommit); otherwise the
    "autocommit" statements after it would run inside it, never committed."""
    o = order()
    transaction.set_autocommit(False)
    try:
        Order.objects.filter(pk=o.pk).update(amount=101)
        with pytest.raises(ProgrammingError, match="can't change 'autocommit' now"):
            transaction.set_autocommit(True)
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)
    assert amount_seen_by(other, o.pk) == 100
    Order.objects.filter(pk=o.pk).update(amount=102)
    assert amount_seen_by(other, o.pk) == 102


class JobTimeout(Exception):
    """What RQ's death penalty raises from its SIGALRM handler."""


def test_the_jobs_timeout_during_a_transactions_first_statement__raised_as_itself(other):
    """The BEGIN and the first statement wait for one answer in a pipeline; a signal
    that interrupts that wait (RQ's job timeout) is raised as itself, the connection
    closed (the server rolls back), and the next use reconnects."""
    o = order()

    def fire(*_: object) -> None:
        raise JobTimeout("the job's time is up")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(JobTimeout), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "UPDATE payments_order SET amount = %s WHERE id = %s RETURNING pg_sleep(1.0)",
                [777, o.pk],
            )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert amount_seen_by(other, o.pk) == 100
    Order.objects.filter(pk=o.pk).update(amount=101)  # a new connection
    assert amount_seen_by(other, o.pk) == 101


# --- timestamptz: Django's loader, psycopg's optimised parsing --------------------------

_TIMESTAMPS = [
    "2026-12-01 10:00:00.123456+00",
    "2026-01-02 03:04:05.5+05:30",
    "1999-12-31 23:59:59-08",
    "1900-01-01 00:00:00+00:19:32",
    "0001-01-01 00:00:00+00",
    "9999-12-31 23:59:59.999999+00",
    "infinity",
    "-infinity",
    "2000-01-01 00:00:00+00 BC",
]


def _load(cursor: object, value: str) -> object:
    """What a cursor gives for `value`::timestamptz: the datetime and its tzinfo, or the error."""
    try:
        cursor.execute("SELECT %s::timestamptz", [value])  # type: ignore[attr-defined]
        loaded = cursor.fetchone()[0]  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 (the error is what is compared)
        return (type(exc).__name__, str(exc))
    return (loaded, loaded.tzinfo)


@pytest.mark.skipif(pq.__impl__ == "python", reason="psycopg has no optimised build here")
def test_timestamptz__read_by_the_orm__parsed_without_psycopgs_python_loader(monkeypatch):
    """Django's own timestamptz loader derives from psycopg's pure-Python one (a regular
    expression per value, Django ticket #36960): the backend's parses in C."""
    from psycopg.types.datetime import TimestamptzLoader

    parsed_in_python: list[bytes] = []
    python_parse = TimestamptzLoader._load_iso

    def counting(self: object, data: bytes) -> object:
        parsed_in_python.append(bytes(data))
        return python_parse(self, data)

    monkeypatch.setattr(TimestamptzLoader, "_load_iso", staticmethod(counting))
    connection.close()  # a new connection, and loaders made after the patch
    o = order()
    read = Order.objects.get(pk=o.pk)
    assert read.created_at == o.created_at
    assert parsed_in_python == []


@pytest.mark.parametrize(
    ("zone", "datestyle"),
    [("UTC", "ISO, MDY"), ("Asia/Kolkata", "ISO, MDY"), ("America/St_Johns", "ISO, MDY"),
     ("UTC", "SQL, DMY")],
)  # fmt: skip
def test_timestamptz__same_values_and_errors_as_djangos_own_loader(zone, datestyle):
    """Whatever the session's TimeZone and DateStyle, every value (and every error: out of
    range, a DateStyle neither parses) is what Django's loader gives: the same instant (as
    Django reads it), tzinfo Django's zone."""
    from django.db.backends.postgresql.psycopg_any import register_tzloader

    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('TimeZone', %s, false)", [zone])
        cursor.execute("SELECT set_config('DateStyle', %s, false)", [datestyle])
        ours = [_load(cursor, value) for value in _TIMESTAMPS]
    with connection.cursor() as cursor:
        register_tzloader(connection.timezone, cursor)  # Django's own loader, this cursor only
        djangos = [_load(cursor, value) for value in _TIMESTAMPS]
    connection.close()  # the session's TimeZone back to Django's on the next connection
    assert ours == djangos
    loaded = [tzinfo for value, tzinfo in ours if isinstance(value, datetime)]
    assert all(tzinfo is connection.timezone for tzinfo in loaded)
    assert len(loaded) >= (4 if datestyle.startswith("ISO") else 0)
