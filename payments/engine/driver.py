"""How the fence's statements reach PostgreSQL: psycopg cursors, pipelines, rows.

The fence (payments.engine.fence) says which statements run and what their
answers mean; this module sends them and reads their rows, on whichever
Django PostgreSQL backend is configured:
- prepared statements on psycopg cursors kept on the connection
  (`statement_cursors`);
- several statements, the statements queued for the open transaction
  (`queue`) and a COMMIT asked for (`commit_with_next_statement`) sent in one
  psycopg pipeline, waiting for one answer (`execute`);
- the rows read into model instances with a plan made once per statement
  (`rows_of`).
It writes nothing of its own: every statement it sends is the fence's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import psycopg
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction
from django.db.backends.postgresql.base import TIMESTAMPTZ_OID
from django.db.backends.postgresql.psycopg_any import register_tzloader
from psycopg import pq
from rq.timeouts import BaseTimeoutException

from payments.exceptions import InvalidTransition

logger = logging.getLogger("payments.engine.fence")

#: A statement to run on its cursor: (Django cursor, SQL, parameters).
Statement = tuple[Any, str, dict[str, Any]]

# --- this thread's connection --------------------------------------------------------


def this_thread() -> Any:
    """This thread's connection, looked up once per statement.

    Each attribute read through `django.db.connection` looks the connection up
    again (a few microseconds, about ten per statement on the worker's path).
    """
    return connections[DEFAULT_DB_ALIAS]


def is_interruption(exc: BaseException | None) -> bool:
    """Tell whether `exc` interrupts the worker from outside: the job's timeout, a signal.

    Not any exception that happened to be handled when a database error came.
    """
    return isinstance(exc, BaseTimeoutException) or (
        exc is not None and not isinstance(exc, Exception)
    )


def begin_owed(db: Any) -> bool:
    """Tell whether the next statement on `db` must send the transaction's BEGIN with it.

    Only the opt-in backend (project.postgresql, DATABASE_BEGIN_WITH_FIRST_STATEMENT=1)
    owes one: with Django's own, psycopg sends the BEGIN itself, in a round trip of
    its own, before the first statement or pipeline.
    """
    owed = getattr(db, "begin_owed", None)  # project.postgresql's DatabaseWrapper
    return owed is not None and bool(owed())


# --- kept cursors, prepared statements ----------------------------------------------------

#: The attribute of a psycopg connection that keeps the fence's psycopg cursors for the
#: next statements (`statement_cursors`): Django's time zone they read in, the cursors.
_KEPT_CURSORS = "fence_kept_cursors"
#: Set on a psycopg connection once its session plans prepared statements generically.
_GENERIC_PLANS = "fence_generic_plans"
#: At most this many are kept (the engine's widest round trip sends four statements).
KEEP_CURSORS = 8


def statement_cursors(db: Any, count: int, first: int = 0) -> tuple[list[Any], bool]:
    """`count` cursors for the fence's statements: prepared once per connection, where
    safe; and whether they are kept (the caller must not close them).

    Each statement is parsed, analysed and planned once per connection
    instead of on every call. Django's usual cursor, nothing prepared, when:
    - the database's OPTIONS pin `prepare_threshold` to None (what
      DATABASE_POOLING=transaction sets): behind PgBouncer in transaction
      pooling a prepared statement would not follow the client to its next
      server session;
    - OPTIONS set `server_side_binding`: the ORM's cursors would be prepared too;
    - queries are logged (DEBUG): Django's cursor logs the SQL with its values.
    The statements name their columns (no `*`), so a column a migration adds
    cannot change a prepared statement's result. A rollback makes psycopg
    forget the connection's prepared statements; the next run prepares again.
    `db` is this thread's connection (`this_thread`). Each cursor is Django's
    wrapper (execute wrappers, error translation) around a psycopg cursor.

    The prepared statements' psycopg cursors are kept on the connection for the
    next statements: a new cursor looks up its loaders (one per result column)
    and dumpers again. The statements of one round trip take distinct ones: the
    `count` from the `first`; every row is read before the next fence statement
    runs (`rows_of`).
    """
    if not prepares(db) or db.queries_logged:
        return [db.cursor() for _ in range(count)], False
    # What connection.cursor() does first: replace a kept connection that broke.
    db.close_if_health_check_failed()
    db.ensure_connection()
    raw = db.connection
    # Only server-side-binding cursors prepare, and the ORM's use client-side
    # binding (checked above): 0 prepares each statement on its first run.
    raw.prepare_threshold = 0
    kept: tuple[Any, list[Any]] | None = getattr(raw, _KEPT_CURSORS, None)
    if kept is None or kept[0] != db.timezone:
        kept = (db.timezone, [])
        setattr(raw, _KEPT_CURSORS, kept)
    if first + count > KEEP_CURSORS:
        # A round trip wider than any of the engine's: cursors of its own, closed after.
        wide = [_psycopg_cursor(db, raw) for _ in range(count)]
        return [db.make_cursor(cast(Any, cursor)) for cursor in wide], False
    cursors = kept[1]
    while len(cursors) < first + count:
        cursors.append(_psycopg_cursor(db, raw))
    # Django wraps a DB-API cursor here (django-stubs type the argument as the wrapper).
    return [db.make_cursor(cast(Any, cursor)) for cursor in cursors[first : first + count]], True


def prepares(db: Any) -> bool:
    """Tell whether the fence may prepare its statements on `db` (`statement_cursors`):
    not when OPTIONS pin `prepare_threshold` to None (a transaction pooler) or set
    `server_side_binding` (the ORM's cursors would be prepared too)."""
    options = db.settings_dict.get("OPTIONS", {})
    return not (
        options.get("prepare_threshold", 0) is None or options.get("server_side_binding") is True
    )


def plan_once_per_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Receiver of Django's `connection_created`: plan the fence's prepared statements
    once per connection, not again at each call (PAYMENTS["GENERIC_PLANS"]).

    With PostgreSQL's default (`plan_cache_mode = auto`) a prepared statement is
    planned again at every execution as long as its generic plan looks costlier
    than the plans made for its values, which it does for the fence's CTEs:
    each paid a new plan at every bind, 0.1-0.3 ms. Every prepared statement of
    the fence reaches its rows by a key (an id, UNIQUE(operation, step)), so its
    generic plan is the one it gets anyway (tests/engine/test_plans.py plans
    each one generically on tables without statistics). The ORM's queries are
    not prepared (client-side binding) and keep planning for their values.

    Sent with the connection's set-up, in autocommit (no rollback can undo it),
    before any job or request uses the connection: a cost per connection, as
    Django's own time-zone set-up, never per transition (with CONN_MAX_AGE 0 a
    connection lasts one request or job). Only on the default database and only
    where the fence prepares (`prepares`: not where OPTIONS pin
    `prepare_threshold` to None, as a transaction pooler needs). A pooled
    psycopg connection is set once (marked). It never fails the connection: a
    SET refused, or PAYMENTS invalid (payments.E009 says so), leaves the
    session as PostgreSQL's default, logged.
    """
    if connection.vendor != "postgresql" or connection.alias != DEFAULT_DB_ALIAS:
        return
    raw = connection.connection
    if getattr(raw, _GENERIC_PLANS, False) or not raw.autocommit or not prepares(connection):
        return
    from payments.conf import payments_settings  # settings are read once a connection opens

    try:
        if not payments_settings().generic_plans:
            return
        raw.execute("SET plan_cache_mode = force_generic_plan")
    except (ImproperlyConfigured, psycopg.Error) as exc:
        logger.warning("fence statements keep PostgreSQL's plan cache mode: %s", exc)
        return
    setattr(raw, _GENERIC_PLANS, True)


def _psycopg_cursor(db: Any, raw: Any) -> Any:
    """A psycopg cursor on `raw` that reads timestamps in Django's time zone (`db`'s)."""
    cursor = psycopg.Cursor(raw)
    if db.timezone != raw.adapters.get_loader(TIMESTAMPTZ_OID, pq.Format.TEXT).timezone:
        # What Django's own cursors do when its time zone changed on an open connection
        # (settings overridden): read timestamps in the new one.
        register_tzloader(db.timezone, cursor)
    return cursor


# --- a COMMIT with the next statement ---------------------------------------------------


class CommitWith:
    """Asks the next fence statement to send the transaction's COMMIT in its round trip."""

    def __init__(self) -> None:
        #: True once the COMMIT went with a statement and succeeded.
        self.committed = False


_COMMIT_WITH_NEXT: ContextVar[CommitWith | None] = ContextVar("commit_with_next", default=None)


@contextmanager
def commit_with_next_statement() -> Iterator[CommitWith]:
    """Inside the block, the next fence statement commits the open transaction with it.

    For payments.engine.unit, which ends its transaction with the statement
    that must commit with it (a claim before its call, the release): the
    statement and the COMMIT go in one round trip (psycopg's pipeline mode),
    and the COMMIT is skipped if the statement fails. The caller closes
    Django's side of the transaction after the block (`CommitWith.committed`).
    """
    marker = CommitWith()
    token = _COMMIT_WITH_NEXT.set(marker)
    try:
        yield marker
    finally:
        _COMMIT_WITH_NEXT.reset(token)


# --- statements queued for the transaction's next one -----------------------------------


@dataclass(frozen=True)
class QueuedStatement:
    """A statement sent in front of the transaction's next fence statement: a run-first
    local step's claim (queue_local_claim_in_tx), a call's outcome (queue_outcome_in_tx)."""

    operation_key: str
    step: str
    sql: str
    params: dict[str, Any]
    #: The atomic block it was queued in (the run's unit): it is sent only there, not
    #: inside a savepoint of it (which could roll it back alone), never in another one.
    block: Any


#: The statements queued for the open transaction, in order.
_QUEUED: ContextVar[tuple[QueuedStatement, ...]] = ContextVar("fence_queued", default=())


def has_queued() -> bool:
    """Tell whether statements are queued for the open transaction (payments.engine.unit)."""
    return bool(_QUEUED.get())


def discard_queued() -> None:
    """Forget the queued statements: their transaction rolled back (payments.engine.unit)."""
    _QUEUED.set(())


def owes_send() -> bool:
    """Tell whether queued statements or a COMMIT asked for wait for the next statement."""
    return has_queued() or _COMMIT_WITH_NEXT.get() is not None


def queue(caller: str, operation_key: str, step: str, sql: str, params: dict[str, Any]) -> None:
    """Queue `sql` for the open transaction's next fence statement (see QueuedStatement)."""
    db = transaction.get_connection()
    if not db.in_atomic_block:
        raise InvalidTransition(f"{caller} must run inside transaction.atomic()")
    queued = QueuedStatement(operation_key, step, sql, params, db.atomic_blocks[-1])
    _QUEUED.set((*_QUEUED.get(), queued))


def _take_queued(db: Any) -> tuple[QueuedStatement, ...]:
    """The queued statements to send with the statement about to run on `db` (none: keep them).

    Sent only in the atomic block they were queued in: inside a savepoint of it
    they stay queued (a savepoint rolled back would take them alone, and the
    step's writes would commit unclaimed). Queued in a transaction that is gone
    (a job that left it open): discarded, loudly, never sent in another one.
    """
    queued = _QUEUED.get()
    if not queued:
        return ()
    blocks = db.atomic_blocks
    block = queued[0].block
    if not any(open_block is block for open_block in blocks):
        logger.error(
            "statements of %s queued in a transaction that ended without them; discarded",
            queued[0].operation_key,
        )
        _QUEUED.set(())
        return ()
    if blocks[-1] is not block:
        return ()  # inside a savepoint: they go with the unit's own next statement
    _QUEUED.set(())
    return queued


# --- sending ----------------------------------------------------------------------------

#: What the fence makes of a failed round trip that carried queued statements: raise the
#: protocol's error for it (from the database's), or return to let it be raised as it is.
OnFailure = Callable[[DatabaseError, tuple[QueuedStatement, ...]], None]


def execute(db: Any, statements: list[Statement], on_failure: OnFailure) -> None:
    """Execute statements, each on its cursor; the COMMIT asked for (CommitWith) after them.

    More than one statement, or a COMMIT to send along, go in psycopg's
    pipeline mode and wait for one answer. Nothing else changes: a statement
    that fails aborts the transaction, and what the pipeline holds after it
    (the next statements, the COMMIT) is not run. Outside a transaction the
    statements of a pipeline form one implicit transaction, committed at its
    end: one that fails rolls back those before it and stops those after it.
    On the opt-in backend a transaction's first statement carries its BEGIN
    the same way (`begin_owed`); on Django's own psycopg sends it first. The
    statements queued for the transaction go in front of the statements; if
    the round trip fails with some, `on_failure` says what that means.
    """
    raw = db.connection
    commit = _COMMIT_WITH_NEXT.get()
    queued = _take_queued(db)
    begin = begin_owed(db)
    if len(statements) == 1 and commit is None and not begin and not queued:
        statements[0][0].execute(statements[0][1], statements[0][2])
        return
    if commit is not None and db.get_autocommit():
        raise InvalidTransition("a COMMIT asked for outside a transaction")
    queued_cursors, kept = (
        statement_cursors(db, len(queued), first=len(statements)) if queued else ([], True)
    )
    try:
        with db.wrap_database_errors:
            ahead = list(zip(queued_cursors, queued, strict=True))
            _pipeline(db, raw, begin, ahead, statements, commit=commit is not None)
    except DatabaseError as exc:
        if queued:
            on_failure(exc, queued)
        raise
    finally:
        if not kept:
            for cursor in queued_cursors:
                cursor.close()
    if commit is not None:
        commit.committed = True


def _pipeline(
    db: Any,
    raw: Any,
    begin: bool,
    queued: list[tuple[Any, QueuedStatement]],
    statements: list[Statement],
    *,
    commit: bool,
) -> None:
    """Send the BEGIN owed, the queued statements, the statements and the COMMIT asked
    for in one psycopg pipeline; wait for its one answer."""
    with one_round_trip(db, raw):
        if begin:
            with db.cursor() as opening:
                opening.execute(db.begin_statement())
        for cursor, ahead in queued:
            cursor.execute(ahead.sql, ahead.params)
        for cursor, sql, params in statements:
            cursor.execute(sql, params)
        if commit:
            _COMMIT_WITH_NEXT.set(None)  # one batch commits; later ones after it
            with db.cursor() as ending:
                ending.execute("COMMIT")


@contextmanager
def one_round_trip(db: Any, raw: Any) -> Iterator[None]:
    """A psycopg pipeline on `raw` (`db`'s connection): what the block executes is sent
    together, and waits for one answer when the block ends (its errors raised there)."""
    try:
        with raw.pipeline():
            yield
    except psycopg.OperationalError as exc:
        interrupted = exc.__context__
        if raw.pgconn.pipeline_status == pq.PipelineStatus.OFF or not is_interruption(interrupted):
            raise
        # Interrupted while the answer was on its way (the job's timeout): psycopg
        # cannot leave pipeline mode and says so instead. The connection is unusable
        # and whether the COMMIT ran is unknown: close it, raise the interruption.
        db.close()
        raise cast(BaseException, interrupted) from None


# --- a savepoint sent with its block's first statement ----------------------------------

#: Django's savepoint statements (DatabaseOperations.savepoint_*_sql: a quoted name).
_SAVEPOINT_SQL = re.compile(r'SAVEPOINT ("[^"]+")\Z')
_SAVEPOINT_END_SQL = re.compile(r'(RELEASE|ROLLBACK TO) SAVEPOINT ("[^"]+")\Z')


class _SavepointWithNextStatement:
    """A Django execute wrapper: see `savepoints_with_next_statement`."""

    def __init__(self) -> None:
        #: SAVEPOINTs Django asked for, not sent yet: (name, statement), oldest first.
        self.held: list[tuple[str, str]] = []

    def __call__(self, execute: Any, sql: Any, params: Any, many: bool, context: dict) -> Any:
        db = context["connection"]
        raw = db.connection
        text = sql if isinstance(sql, str) else ""
        status = raw.info.transaction_status
        created = _SAVEPOINT_SQL.match(text)
        if created and status == pq.TransactionStatus.INTRANS:
            self.held.append((created[1], text))
            return None
        ended = _SAVEPOINT_END_SQL.match(text)
        if ended and status != pq.TransactionStatus.INERROR:
            names = [name for name, _ in self.held]
            if ended[2] in names:  # never sent: nothing to release or to roll back
                del self.held[names.index(ended[2]) :]
                return None
            if ended[1] == "RELEASE":
                return None  # the transaction's COMMIT or ROLLBACK ends it
            self.held.clear()  # created after the savepoint rolled back to: gone with it
            return execute(sql, params, many, context)
        # An aborted transaction (a statement's error caught inside the block): what Django
        # sends goes as it sends it, and fails as it would (Django then rolls back to the
        # savepoint, or marks the transaction for rollback), never left looking fine.
        if not self.held:
            return execute(sql, params, many, context)
        held, self.held = self.held, []
        # One round trip of their own for the savepoints and the statement, unless the
        # caller's pipeline is open (they ride it), or the statement is what a pipeline
        # refuses: a server-side cursor's (QuerySet.iterator()), or text without
        # parameters, which may hold several commands (a RunSQL); then the savepoints go
        # first, in a round trip of their own.
        together = (
            raw.pgconn.pipeline_status == pq.PipelineStatus.OFF
            and bool(params)
            and not isinstance(context["cursor"].cursor, psycopg.ServerCursor)
        )
        opening = raw.cursor()  # Django's cursor class: client-side binding, never prepared
        try:
            with db.wrap_database_errors, one_round_trip(db, raw) if together else nullcontext():
                for _, statement in held:
                    opening.execute(statement)
                return execute(sql, params, many, context)
        finally:
            opening.close()


@contextmanager
def savepoints_with_next_statement() -> Iterator[None]:
    """Inside the block, a savepoint costs no round trip of its own on this thread's
    connection.

    For an atomic block nested in a transaction that PostgreSQL has begun
    (payments.engine.dispatch's inline follow-ups): Django's SAVEPOINT is held
    and sent with the block's first statement, in one round trip (psycopg's
    pipeline mode); a block that sends nothing sends no savepoint either. Its
    RELEASE is not sent: the savepoint stays PostgreSQL's until the
    transaction's COMMIT or ROLLBACK, which end it, and what follows runs in
    it (the same rows, locks and outcome: a savepoint is only ever rolled
    back to, and then by Django's ROLLBACK TO, which is sent). In a transaction
    an error aborted, they go as Django sends them. Only what goes through
    Django's execute wrappers (the ORM, `connection.cursor()`'s execute and
    executemany, the fence's statements) is seen: a statement sent on the
    psycopg connection itself, or by a cursor's `callproc()` or `copy()`,
    would run before the savepoint held for it. A statement a pipeline
    refuses (a server-side cursor's, text without parameters) gets the held
    savepoint in a round trip of its own, as without the block.
    """
    with this_thread().execute_wrapper(_SavepointWithNextStatement()):
        yield


# --- rows into model instances ----------------------------------------------------------

#: Per statement and model: where each of the model's fields is in the statement's row
#: (with its database converter, None: none), the fields' attnames, and the other columns
#: (name, place). Read from the statement's first answer in this process (psycopg builds a
#: description object per column on every read).
_ROW_PLANS: dict[tuple[str, type[Any]], tuple[Any, list[str], Any]] = {}


def _row_plan(model: type[Any], sql: str, cursor: Any) -> tuple[Any, list[str], Any]:
    """How a row of `sql` becomes an instance of `model` (see _ROW_PLANS)."""
    plan = _ROW_PLANS.get((sql, model))
    if plan is None:
        names = [column.name for column in cursor.description]
        place = {name: i for i, name in enumerate(names)}
        fields = model._meta.concrete_fields
        fields_at = tuple((place[f.column], getattr(f, "from_db_value", None)) for f in fields)
        taken = {i for i, _ in fields_at}
        others = tuple((name, i) for i, name in enumerate(names) if i not in taken)
        plan = _ROW_PLANS[(sql, model)] = (fields_at, [f.attname for f in fields], others)
    return plan


def rows_of(
    statements: list[tuple[type[Any], str, dict[str, Any]]], on_failure: OnFailure
) -> list[Any]:
    """Run statements that each return at most one row of their own model, in one round
    trip (a pipeline: a failing one stops the rest); return each one's row as an
    instance of its model, or None.

    The row becomes a model instance as a queryset would make it (JSON
    decoded, `from_db`); columns that are not the model's (`from_state`,
    `db_now`) become attributes. A plain cursor, not `raw()`: the statements
    are on every worker's path and `raw()` maps the columns anew each time.
    """
    db = this_thread()
    cursors, kept = statement_cursors(db, len(statements))
    try:
        execute(
            db,
            [
                (cursor, sql, params)
                for cursor, (_, sql, params) in zip(cursors, statements, strict=True)
            ],
            on_failure,
        )
        with db.wrap_database_errors:
            # Every row read before any becomes an instance: making one runs the model's
            # pre_init/post_init receivers, which may run fence statements of their own
            # (on the kept cursors, whose rows must be read by then).
            rows = [
                (model, sql, cursor.cursor, cursor.cursor.fetchone())
                for cursor, (model, sql, _) in zip(cursors, statements, strict=True)
            ]
            plans = [
                None if row is None else _row_plan(model, sql, raw_cursor)
                for model, sql, raw_cursor, row in rows
            ]
        return [
            _instance(model, db, row, plan)
            for (model, _, _, row), plan in zip(rows, plans, strict=True)
        ]
    finally:
        if not kept:
            for cursor in cursors:
                cursor.close()


def _instance(model: type[Any], db: Any, row: tuple[Any, ...] | None, plan: Any) -> Any:
    """`row` (a statement's, read with its `_row_plan`) as an instance of `model`, or None."""
    if row is None:
        return None
    fields_at, attnames, others = plan
    values = [
        row[i] if convert is None or row[i] is None else convert(row[i], None, db)
        for i, convert in fields_at
    ]
    instance = model.from_db(db.alias, attnames, values)
    for name, i in others:
        setattr(instance, name, row[i])
    return instance
