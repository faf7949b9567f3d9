"""The fence core: operations, step claims and their audit trail.

It knows no HTTP, no business step, no admin screen and no view: handlers, the
admin desk, the API and the recovery code call into it. Functions whose name
ends in `_in_tx` (or whose docstring says so) run inside the caller's
transaction; the others own theirs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NoReturn, cast

import psycopg
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    connection,
    connections,
    transaction,
)
from django.db.backends.postgresql.base import TIMESTAMPTZ_OID
from django.db.backends.postgresql.psycopg_any import register_tzloader
from django.db.models.functions import Now
from django.utils import timezone
from psycopg import pq
from rq.timeouts import BaseTimeoutException

from inbox.models import InboxEntry
from payments.conf import payments_settings
from payments.engine import transitions
from payments.engine.effects import EffectResult
from payments.engine.failpoints import BEFORE_RECORD_COMMIT, failpoint
from payments.engine.writes import fence_writer
from payments.exceptions import (
    InvalidTransition,
    NotClaimOwner,
    OperationConflict,
    OutcomeRefused,
    StepDoneMeanwhile,
)
from payments.models import (
    RUNNABLE_OPERATION_STATES,
    ApiClient,
    ClaimState,
    KeyScope,
    Operation,
    OperationState,
    StepClaim,
)

logger = logging.getLogger("payments.engine.fence")

# --- keys and fingerprints -----------------------------------------------------


def fingerprint(kind: str, entity_type: str, entity_id: str, params: dict[str, Any]) -> str:
    """Hash what makes two requests the same intent (kind, entity, parameters)."""
    canonical = json.dumps(
        {"kind": kind, "entity": [entity_type, str(entity_id)], "params": params},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def derive_idempotency_key(
    operation_key: str, step: str, scope: str = KeyScope.CLIENT, client_id: int | None = None
) -> str:
    """Derive the provider idempotency key of a step: stable, bounded, no attempt number.

    A derived operation's scope goes into the hash, so that a client key equal
    to a derived key can never share a provider idempotency key with it; the
    client goes in too, so that two shops using the same key (their own order
    numbers, say) never share one either. A claim stores its key when it is
    inserted and every request under it sends that stored key: a claim made
    before the client went into the hash keeps the key it was made with.
    """
    name = operation_key if scope == KeyScope.CLIENT else f"{scope}\x1e{operation_key}"
    if client_id is not None:
        name = f"client:{client_id}\x1d{name}"
    digest = hashlib.sha256(f"{name}\x1f{step}".encode()).hexdigest()
    return f"fence_{digest[:48]}"


def follow_up_key(parent: Operation, kind: str) -> str:
    """Return the derived key of `parent`'s follow-up of `kind` (scope DERIVED)."""
    return f"{parent.pk}:{kind}"


def attempt_key(first: Operation, attempt: int) -> str:
    """Return the derived key of attempt `attempt` (2, 3, ...) of the first operation `first`."""
    return f"{first.pk}:attempt-{attempt}"


# --- who acts, and the clock -------------------------------------------------------


def actor_id(role: str) -> str:
    """Return an actor id unique to this process: role, host, pid and a random suffix.

    Claims and leases are owned by these ids; two processes never share one,
    so neither mistakes the other's live claim for its own.
    """
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@functools.cache
def process_actor(role: str, pid: int | None = None) -> str:
    """Return this process's actor id for `role` (one per process: cached by pid)."""
    return actor_id(role)


def clock_of(row: Operation | StepClaim) -> datetime:
    """Return the database's clock read with a locked row (its `db_now` annotation)."""
    return cast(datetime, cast(Any, row).db_now)


def db_now() -> datetime:
    """Return PostgreSQL's clock (the transaction's start inside one): the only clock for leases.

    Every host compares leases against the database's time, so a host whose
    clock drifts cannot take over a live lease or keep an expired one.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    return now


# --- one statement per transition --------------------------------------------------
#
# A transition on a worker's path (take the lease, claim, settle, leave the lease,
# create) is ONE data-modifying statement: the row lock, the compare-and-set, the
# change and its audit row travel together. Outside a transaction it is its own
# transaction (one round trip, committed when it returns; the lease shares its
# implicit transaction with the reads of its entity, `acquire_lease`); inside the
# caller's it joins it. Each statement's WHERE clause accepts exactly the from-states the
# transition table allows (transitions.operation_sources / claim_sources); when it
# changes nothing, the Python check on a fresh read raises with both states.
# String parameters are cast (`::text`): a prepared statement (see
# `_statement_cursor`) types each parameter once, and one used both as a column's
# value and in a comparison would otherwise get two types.
# An UPDATE joined to its locked row (`FROM old`) also names the row by its id
# parameter: planned on a table without statistics (new, or emptied), the join alone
# may become a scan of the whole table, kept by the prepared statement's plan as the
# table grows (tests/engine/test_plans.py).


def _columns(model: type[Any], alias: str = "") -> str:
    """The model's columns, named (a statement's result must not follow the table's `*`)."""
    prefix = f"{alias}." if alias else ""
    return ", ".join(f'{prefix}"{field.column}"' for field in model._meta.concrete_fields)


#: What each statement returns of its row, by name.
OPERATION_COLUMNS = _columns(Operation)
CLAIM_COLUMNS = _columns(StepClaim)

#: The audit row's columns, in the order the statements below select them.
AUDIT_INSERT = (
    "INSERT INTO payments_operationevent "
    "(operation_id, step, from_state, to_state, actor, reason, created_at)"
)


#: The attribute of a psycopg connection that keeps the fence's psycopg cursors for the
#: next statements (`_statement_cursors`): Django's time zone they read in, the cursors.
_KEPT_CURSORS = "fence_kept_cursors"
#: At most this many are kept (the engine's widest round trip sends four statements).
KEEP_CURSORS = 8


def _statement_cursors(db: Any, count: int, first: int = 0) -> tuple[list[Any], bool]:
    """`count` cursors for the statements below: prepared once per connection, where safe;
    and whether they are kept (the caller must not close them).

    Each statement is parsed, analysed and planned once per connection
    instead of on every call (about half a fence statement's cost on
    PostgreSQL, measured by `make bench`). Django's usual cursor, nothing
    prepared, when:
    - the database's OPTIONS pin `prepare_threshold` to None (what
      DATABASE_POOLING=transaction sets): behind PgBouncer in transaction
      pooling a prepared statement would not follow the client to its next
      server session;
    - OPTIONS set `server_side_binding`: the ORM's cursors would be prepared too;
    - queries are logged (DEBUG): Django's cursor logs the SQL with its values.
    The statements name their columns (no `*`), so a column a migration adds
    cannot change a prepared statement's result. A rollback makes psycopg
    forget the connection's prepared statements; the next run prepares again.
    `db` is this thread's connection (`_this_thread`). Each cursor is Django's
    wrapper (execute wrappers, error translation) around a psycopg cursor.

    The prepared statements' psycopg cursors are kept on the connection for the
    next statements: a new cursor looks up its loaders (one per result column)
    and dumpers again, about 0.85 M instructions per checkout. The statements of
    one round trip take distinct ones: the `count` from the `first`; every row
    is read before the next fence statement runs (`_rows_of`).
    """
    options = db.settings_dict.get("OPTIONS", {})
    if (
        options.get("prepare_threshold", 0) is None
        or options.get("server_side_binding") is True
        or db.queries_logged
    ):
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


def _psycopg_cursor(db: Any, raw: Any) -> Any:
    """A psycopg cursor on `raw` that reads timestamps in Django's time zone (`db`'s)."""
    cursor = psycopg.Cursor(raw)
    if db.timezone != raw.adapters.get_loader(TIMESTAMPTZ_OID, pq.Format.TEXT).timezone:
        # What Django's own cursors do when its time zone changed on an open connection
        # (settings overridden): read timestamps in the new one.
        register_tzloader(db.timezone, cursor)
    return cursor


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


@fence_writer
def send_queued_in_tx() -> None:
    """Send the queued statements now (with the COMMIT asked for, `commit_with_next_statement`)."""
    if has_queued() or _COMMIT_WITH_NEXT.get() is not None:
        _execute(_this_thread(), [])


def _execute(db: Any, statements: list[tuple[Any, str, dict[str, Any]]]) -> None:
    """Execute fence statements, each on its cursor; the COMMIT asked for (CommitWith) after them.

    More than one statement, or a COMMIT to send along, go in psycopg's
    pipeline mode and wait for one answer. Nothing else changes: a statement
    that fails aborts the transaction, and what the pipeline holds after it
    (the next statements, the COMMIT) is not run. Outside a transaction the
    statements of a pipeline form one implicit transaction, committed at its
    end: one that fails rolls back those before it and stops those after it.
    A transaction's first
    statement carries its BEGIN the same way (project.postgresql), and the
    statements queued for the transaction go in front of the statements: a
    claim found taken raises StepDoneMeanwhile (queue_local_claim_in_tx), an
    outcome that settled nothing raises OutcomeRefused (queue_outcome_in_tx).
    """
    raw = db.connection
    commit = _COMMIT_WITH_NEXT.get()
    queued = _take_queued(db)
    # Django's transaction is open and PostgreSQL's not yet: the BEGIN goes first in the
    # pipeline (project.postgresql; Django's stock backend lets psycopg send it alone).
    begin = _begin_owed(db)
    if len(statements) == 1 and commit is None and not begin and not queued:
        statements[0][0].execute(statements[0][1], statements[0][2])
        return
    if commit is not None and db.get_autocommit():
        raise InvalidTransition("a COMMIT asked for outside a transaction")
    queued_cursors, kept = (
        _statement_cursors(db, len(queued), first=len(statements)) if queued else ([], True)
    )
    try:
        with db.wrap_database_errors:
            try:
                with raw.pipeline():
                    if begin:
                        with db.cursor() as opening:
                            opening.execute(db.begin_statement())
                    for cursor, claim in zip(queued_cursors, queued, strict=True):
                        cursor.execute(claim.sql, claim.params)
                    for cursor, sql, params in statements:
                        cursor.execute(sql, params)
                    if commit is not None:
                        _COMMIT_WITH_NEXT.set(None)  # one batch commits; later ones after it
                        with db.cursor() as ending:
                            ending.execute("COMMIT")
            except psycopg.OperationalError as exc:
                interrupted = exc.__context__
                if raw.pgconn.pipeline_status == pq.PipelineStatus.OFF or not is_interruption(
                    interrupted
                ):
                    raise
                # Interrupted while the answer was on its way (the job's timeout): psycopg
                # cannot leave pipeline mode and says so instead. The connection is unusable
                # and whether the COMMIT ran is unknown: close it, raise the interruption.
                db.close()
                raise cast(BaseException, interrupted) from None
    except IntegrityError as exc:
        if queued and _is_claim_taken(exc):
            # Only a queued claim inserts without ON CONFLICT: another run committed the
            # step while this one ran it. Nothing after it ran, the COMMIT included.
            step = _taken_step(exc, [claim.step for claim in queued])
            raise StepDoneMeanwhile(operation_key=queued[0].operation_key, step=step) from exc
        raise
    except DatabaseError as exc:
        settles = [q for q in queued if q.sql is SETTLE_CLAIM_OR_REFUSE]
        if settles and _is_refusal(exc):
            # A queued outcome settled nothing. Nothing after it ran, the COMMIT included.
            detail = str(cast(Any, exc.__cause__).diag.message_primary)
            named = (q for q in settles if f" {q.operation_key}:{q.step} " in detail)
            refused = next(named, settles[0])
            raise OutcomeRefused(
                operation_key=refused.operation_key, step=refused.step, detail=detail
            ) from exc
        raise
    finally:
        if not kept:
            for cursor in queued_cursors:
                cursor.close()
    if commit is not None:
        commit.committed = True


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


def _is_claim_taken(exc: IntegrityError) -> bool:
    """Tell whether `exc` is a unique violation of the step claims (the step is claimed)."""
    diag = getattr(exc.__cause__, "diag", None)
    return diag is not None and diag.constraint_name == StepClaim.UNIQUE_CONSTRAINT


def _is_refusal(exc: DatabaseError) -> bool:
    """Tell whether `exc` is payments_fence_refuse()'s error (migration payments 0009)."""
    return getattr(exc.__cause__, "sqlstate", None) == REFUSAL_SQLSTATE


def _taken_step(exc: IntegrityError, steps: list[str]) -> str:
    """Which of `steps` the unique violation `exc` names (its detail), else the first."""
    # "Key (operation_id, step)=(12, invoice) already exists."
    detail = getattr(exc.__cause__, "diag", None)
    text = (detail.message_detail if detail is not None else None) or ""
    named = text[text.find("=(") + 2 : text.rfind(")")].partition(", ")[2]
    return named if named in steps else steps[0]


def _begin_owed(db: Any) -> bool:
    """Tell whether the next statement on `db` must send the transaction's BEGIN with it."""
    owed = getattr(db, "begin_owed", None)  # project.postgresql's DatabaseWrapper
    return owed is not None and bool(owed())


def is_interruption(exc: BaseException | None) -> bool:
    """Tell whether `exc` interrupts the worker from outside: the job's timeout, a signal.

    Not any exception that happened to be handled when a database error came.
    """
    return isinstance(exc, BaseTimeoutException) or (
        exc is not None and not isinstance(exc, Exception)
    )


def _this_thread() -> Any:
    """This thread's connection, looked up once per statement.

    Each attribute read through `django.db.connection` looks the connection up
    again (a few microseconds, about ten per statement on the worker's path).
    """
    return connections[DEFAULT_DB_ALIAS]


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


def _one(model: type[Any], sql: str, params: dict[str, Any]) -> Any:
    """Run one statement that returns at most one row of `model`; return it, or None.

    The row becomes a model instance as a queryset would make it (JSON
    decoded, `from_db`); columns that are not the model's (`from_state`,
    `db_now`) become attributes. A plain cursor, not `raw()`: the statements
    are on every worker's path and `raw()` maps the columns anew each time.
    """
    return _rows(model, [(sql, params)])[0]


def _rows(model: type[Any], statements: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Run statements that each return at most one row of `model`, in one round trip (a
    pipeline: a failing one stops the rest); return each one's row or None."""
    return _rows_of([(model, sql, params) for sql, params in statements])


def _rows_of(statements: list[tuple[type[Any], str, dict[str, Any]]]) -> list[Any]:
    """`_rows` for statements that each return at most one row of their own model."""
    db = _this_thread()
    cursors, kept = _statement_cursors(db, len(statements))
    try:
        _execute(
            db,
            [
                (cursor, sql, params)
                for cursor, (_, sql, params) in zip(cursors, statements, strict=True)
            ],
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


def _json(value: Any) -> str | None:
    """A JSON document for a `%s::jsonb` parameter (None stays SQL NULL)."""
    return None if value is None else json.dumps(value)


# --- audit -----------------------------------------------------------------------


#: One audit row, stamped by the database's clock like every statement above.
RECORD_EVENT = f"""
{AUDIT_INSERT}
VALUES (%(operation)s, %(step)s, %(from_state)s, %(to_state)s, %(actor)s, %(reason)s,
        statement_timestamp())
"""


@fence_writer
def record_event_in_tx(
    operation: Operation,
    *,
    to_state: str,
    actor: str,
    from_state: str = "",
    step: str = "",
    reason: str = "",
) -> None:
    """Write one audit row. Runs inside the caller's transaction.

    Stamped with PostgreSQL's clock, as the one-statement transitions stamp
    theirs: the trail's order (created_at, id) never depends on which host
    wrote a row or how far its clock drifts.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            RECORD_EVENT,
            {
                "operation": operation.pk,
                "step": step,
                "from_state": from_state,
                "to_state": to_state,
                "actor": actor[:255],
                "reason": reason,
            },
        )


# --- operations ------------------------------------------------------------------


#: Create an operation (none -> pending), audited; a key already taken returns nothing.
CREATE_OPERATION = f"""
WITH created AS (
    INSERT INTO payments_operation (
        key, scope, client_id, parent_id, retry_of_id, kind, entity_type, entity_id, params,
        fingerprint, state, attempts, last_error, lease_owner, job_id, dispatched_at,
        created_at, updated_at
    )
    VALUES (
        %(key)s::text, %(scope)s::text, %(client)s, %(parent)s, %(retry_of)s, %(kind)s::text,
        %(entity_type)s::text, %(entity_id)s::text, %(params)s::jsonb, %(fingerprint)s::text,
        'pending', 0, '', '', %(job_id)s::text,
        CASE WHEN %(job_id)s::text <> '' THEN statement_timestamp() END,
        statement_timestamp(), statement_timestamp()
    )
    ON CONFLICT ON CONSTRAINT {Operation.KEY_CONSTRAINT} DO NOTHING
    RETURNING {OPERATION_COLUMNS}
), audit AS (
    {AUDIT_INSERT}
    SELECT id, '', '', 'pending', %(actor)s::text, 'created', statement_timestamp() FROM created
)
SELECT {OPERATION_COLUMNS} FROM created
"""


@fence_writer
def create_operation_in_tx(
    *,
    key: str,
    kind: str,
    entity_type: str,
    entity_id: str | int,
    params: dict[str, Any],
    actor: str,
    retry_of: Operation | None = None,
    parent: Operation | None = None,
    scope: str = KeyScope.CLIENT,
    client: ApiClient | None = None,
    job_id: str = "",
) -> tuple[Operation, bool]:
    """Create the operation for `key`, or return the existing one with the same fingerprint.

    Runs inside the caller's transaction, next to the business change that asks
    for it (the row is the durable outbox). Keys are scoped per API client and
    per scope: two clients' keys never meet. `job_id` records the delivery the
    caller will enqueue once the transaction commits (dispatch does that), in
    the same statement. Returns (operation, created).
    Raises OperationConflict when the key exists with another fingerprint.
    """
    (created,) = create_operations_in_tx(
        [
            NewOperation(
                key=key,
                kind=kind,
                entity_type=entity_type,
                entity_id=entity_id,
                params=params,
                actor=actor,
                retry_of=retry_of,
                parent=parent,
                scope=scope,
                client=client,
                job_id=job_id,
            )
        ]
    )
    return created


@dataclass(frozen=True)
class NewOperation:
    """What `create_operation_in_tx` takes, for creating several in one round trip."""

    key: str
    kind: str
    entity_type: str
    entity_id: str | int
    params: dict[str, Any]
    actor: str
    retry_of: Operation | None = None
    parent: Operation | None = None
    scope: str = KeyScope.CLIENT
    client: ApiClient | None = None
    job_id: str = ""


@fence_writer
def create_operations_in_tx(new: list[NewOperation]) -> list[tuple[Operation, bool]]:
    """`create_operation_in_tx` for each of `new`, their statements in one round trip.

    The statements go in one pipeline, in order, each as it would go alone (a
    failing one stops those after it and aborts the transaction, as it would
    have one by one). A taken key is then looked up, as alone. Returns
    (operation, created) for each, in order. A key taken with other parameters
    raises OperationConflict and, in a batch of several, marks the innermost
    atomic block around it (the caller's transaction, or its savepoint) for
    rollback: unlike one by one, the statements after it ran.
    """
    if not transaction.get_connection().in_atomic_block:
        raise InvalidTransition("create_operation_in_tx must run inside transaction.atomic()")
    fingerprints = [
        fingerprint(one.kind, one.entity_type, str(one.entity_id), one.params) for one in new
    ]
    rows = _rows(
        Operation,
        [
            (
                CREATE_OPERATION,
                {
                    "key": one.key,
                    "scope": one.scope,
                    "client": one.client.pk if one.client is not None else None,
                    "parent": one.parent.pk if one.parent is not None else None,
                    "retry_of": one.retry_of.pk if one.retry_of is not None else None,
                    "kind": one.kind,
                    "entity_type": one.entity_type,
                    "entity_id": str(one.entity_id),
                    "params": _json(one.params),
                    "fingerprint": fp,
                    "job_id": one.job_id,
                    "actor": one.actor[:255],
                },
            )
            for one, fp in zip(new, fingerprints, strict=True)
        ],
    )
    try:
        return [
            (op, True) if op is not None else (_existing(one, fp), False)
            for one, fp, op in zip(new, fingerprints, rows, strict=True)
        ]
    except OperationConflict:
        if len(new) > 1:
            # The statements after the conflicting one ran too (one pipeline), which one
            # by one they would not have: none of the batch may commit, even if the
            # caller catches the conflict (the innermost atomic block rolls back).
            transaction.set_rollback(True)
        raise


def _existing(new: NewOperation, fp: str) -> Operation:
    """The operation holding `new`'s key (ON CONFLICT waited for a concurrent inserter to
    commit); OperationConflict if it was created with other parameters."""
    existing = Operation.objects.get(client=new.client, scope=new.scope, key=new.key)
    if existing.fingerprint != fp:
        raise OperationConflict(
            new.key,
            existing_kind=existing.kind,
            existing_entity=f"{existing.entity_type} {existing.entity_id}",
        )
    return existing


@fence_writer
def transition_in_tx(
    operation: Operation,
    to_state: OperationState,
    *,
    actor: str,
    reason: str = "",
    **fields: Any,
) -> None:
    """Move a locked operation to `to_state`, audited. Runs inside the caller's transaction.

    The caller holds the row (select_for_update) so the check and the write are one.
    """
    from_state = operation.state
    transitions.check_operation(operation.key, from_state, to_state)
    operation.state = to_state
    for name, value in fields.items():
        setattr(operation, name, value)
    operation.save(update_fields=["state", "updated_at", *fields])
    if from_state != to_state or reason:
        record_event_in_tx(
            operation, from_state=from_state, to_state=to_state, actor=actor, reason=reason
        )


@fence_writer
def record_dispatch_in_tx(operation_id: int, job_id: str) -> None:
    """Record the job id of a new delivery, by the DB's clock. Runs in the caller's transaction.

    Not a state change: the sweeper reads it to tell a live delivery from a lost one.
    """
    Operation.objects.filter(pk=operation_id).update(job_id=job_id, dispatched_at=Now())


def locked_operation_in_tx(operation_id: int) -> Operation:
    """Return the operation row locked FOR UPDATE. Runs inside the caller's transaction.

    The row carries `db_now`, the database's clock read in the same statement.
    """
    return Operation.objects.select_for_update().annotate(db_now=Now()).get(pk=operation_id)


def lease_alive(operation: Operation, now: datetime) -> bool:
    """Tell whether a worker holds the operation's lease at `now` (the database's clock)."""
    return (
        operation.state == OperationState.RUNNING
        and operation.lease_expires_at is not None
        and operation.lease_expires_at > now
    )


@dataclass(frozen=True)
class LeaseResult:
    """The answer of acquire_lease: the operation, and whether this worker now holds it."""

    operation: Operation
    acquired: bool
    #: The steps claimed when the lease was taken: a local step not among them runs its
    #: function first (payments.engine.handlers.Run.local). None when the lease was not
    #: taken, or was taken over from a worker that may still be running.
    claimed_steps: frozenset[str] | None = None
    #: The rows read with the lease (`entities`), by model: the operation's entity when it
    #: is of that model, else None. Empty when the lease was not taken.
    entities: dict[type[Any], Any] = field(default_factory=dict)


#: Per model: the statement that reads the operation's entity when it is one of the
#: model's rows (entity_type is the model's name, entity_id its integer key), else nothing.
_READ_ENTITY: dict[type[Any], str] = {}


def _read_entity_sql(model: type[Any]) -> str:
    sql = _READ_ENTITY.get(model)
    if sql is None:
        quote = _this_thread().ops.quote_name
        sql = _READ_ENTITY[model] = f"""
SELECT {_columns(model)} FROM {quote(model._meta.db_table)}
WHERE {quote(model._meta.pk.column)} = (
    SELECT CASE WHEN entity_type = %(entity_type)s::text AND entity_id ~ '^[0-9]{{1,18}}$'
                THEN entity_id::bigint END
    FROM payments_operation WHERE id = %(id)s
)
"""
    return sql


#: pending | retrying | running (its lease run out, or this owner's) -> running, audited.
ACQUIRE_LEASE = f"""
WITH old AS (
    SELECT id, state FROM payments_operation WHERE id = %(id)s FOR UPDATE
), leased AS (
    UPDATE payments_operation AS op
    SET state = 'running', lease_owner = %(owner)s::text,
        lease_expires_at = statement_timestamp() + make_interval(secs => %(seconds)s),
        next_attempt_at = NULL, updated_at = statement_timestamp()
    FROM old
    WHERE op.id = %(id)s AND op.id = old.id
      AND old.state = ANY(%(from_states)s)
      AND NOT (old.state = 'running' AND op.lease_owner <> %(owner)s::text
               AND COALESCE(op.lease_expires_at > statement_timestamp(), false))
    RETURNING {_columns(Operation, "op")}, old.state AS from_state,
              statement_timestamp() AS db_now
), audit AS (
    {AUDIT_INSERT}
    SELECT id, '', from_state, 'running', %(owner)s::text,
           CASE WHEN from_state = 'running' THEN 'lease expired; taken over' ELSE '' END,
           statement_timestamp()
    FROM leased
)
SELECT {OPERATION_COLUMNS}, from_state, db_now,
       ARRAY(SELECT step FROM payments_stepclaim WHERE operation_id = leased.id) AS claimed_steps
FROM leased
"""


def _lease_with(
    operation_id: int,
    owner: str,
    seconds: int,
    runnable: list[str],
    entities: tuple[type[Any], ...],
) -> list[Any]:
    """ACQUIRE_LEASE and the reads of `entities`, in one pipeline: each one's row or None."""
    return _rows_of(
        [
            (
                Operation,
                ACQUIRE_LEASE,
                {
                    "id": operation_id,
                    "owner": owner[:255],
                    "seconds": seconds,
                    "from_states": runnable,
                },
            ),
            *(
                (model, _read_entity_sql(model), {"id": operation_id, "entity_type": name})
                for model in entities
                for name in [model._meta.model_name]
            ),
        ]
    )


@fence_writer
def acquire_lease(
    operation_id: int, *, owner: str, seconds: int, entities: tuple[type[Any], ...] = ()
) -> LeaseResult:
    """Take the operation's lease if it is runnable and no live lease is held.

    One statement (ACQUIRE_LEASE) in the happy path; when it takes nothing,
    one read tells the caller why (state, or another worker's live lease).
    `entities` (models with an integer key) are read in the same round trip,
    after the lease in the same implicit transaction (it sees the lease): the
    operation's entity, if it is a row of one of them
    (payments.engine.handlers: `@handler(entity=...)`). If a read fails, the
    lease is taken alone (logged): no entity's read stops a lease.
    Raises Operation.DoesNotExist for an unknown id.
    """
    runnable = [
        state
        for state in transitions.operation_sources(OperationState.RUNNING)
        if state in RUNNABLE_OPERATION_STATES
    ]
    try:
        op, *rows = _lease_with(operation_id, owner, seconds, runnable, entities)
    except DatabaseError:
        if not entities:
            raise
        # A read failed (a migration not run yet, a table locked past a timeout): it
        # rolled the lease back with it. Every kind's lease carries every declared
        # entity's read, so none may stop the others: take the lease alone, and the
        # handler reads its entity itself (Run.entity).
        logger.exception("reading %s with the lease failed; taking the lease alone", entities)
        return acquire_lease(operation_id, owner=owner, seconds=seconds)
    if op is not None:
        claimed = frozenset(op.__dict__.pop("claimed_steps"))
        # Taken over from a worker whose lease ran out: it may still be running,
        # so this run's local steps claim first (payments.engine.handlers.Run.local).
        taken_over = op.from_state == OperationState.RUNNING
        return LeaseResult(
            op,
            acquired=True,
            claimed_steps=None if taken_over else claimed,
            entities=dict(zip(entities, rows, strict=True)),
        )
    return LeaseResult(
        Operation.objects.annotate(db_now=Now()).get(pk=operation_id), acquired=False
    )


def release_in_tx(
    operation: Operation,
    to_state: OperationState,
    *,
    actor: str,
    reason: str = "",
    **fields: Any,
) -> None:
    """Leave RUNNING for `to_state` and drop the lease. Runs inside the caller's transaction."""
    transition_in_tx(
        operation,
        to_state,
        actor=actor,
        reason=reason,
        lease_owner="",
        lease_expires_at=None,
        **fields,
    )


#: running (held by this owner) -> a run's outcome, lease dropped, audited.
RELEASE_HELD_LEASE = f"""
WITH old AS (
    SELECT id, state FROM payments_operation
    WHERE id = %(id)s AND state = 'running' AND lease_owner = %(owner)s::text
    FOR UPDATE
), released AS (
    UPDATE payments_operation AS op
    SET state = %(to_state)s::text, lease_owner = '', lease_expires_at = NULL,
        updated_at = statement_timestamp(){{fields}}
    FROM old
    WHERE op.id = %(id)s AND op.id = old.id
      AND op.state = 'running' AND op.lease_owner = %(owner)s::text
    RETURNING {_columns(Operation, "op")}, old.state AS from_state
), audit AS (
    {AUDIT_INSERT}
    SELECT id, '', from_state, %(to_state)s::text, %(owner)s::text, %(reason)s::text,
           statement_timestamp()
    FROM released
)
SELECT {OPERATION_COLUMNS}, from_state FROM released
"""
#: The columns a release may set besides the state and the lease.
RELEASE_FIELDS = frozenset({"last_error", "next_attempt_at", "attempts", "result"})


@fence_writer
def release_held_lease(
    operation: Operation,
    to_state: OperationState,
    *,
    owner: str,
    reason: str = "",
    **fields: Any,
) -> Operation | None:
    """Leave RUNNING for `to_state` if `owner` still holds the lease; return the row, or None.

    One statement (RELEASE_HELD_LEASE): the check that this worker still
    holds the lease, the change and its audit row. None: the lease was lost
    (run out and taken over), nothing changed. Own transaction, or the caller's.
    """
    transitions.check_operation(operation.key, OperationState.RUNNING, to_state)
    unknown = set(fields) - RELEASE_FIELDS
    if unknown:
        raise InvalidTransition(f"a release cannot set {sorted(unknown)}")
    json_columns = {"result"}
    assignments = "".join(
        f", {name} = %({name})s" + ("::jsonb" if name in json_columns else "")
        for name in sorted(fields)
    )
    values = {name: _json(v) if name in json_columns else v for name, v in fields.items()}
    return _one(
        Operation,
        RELEASE_HELD_LEASE.replace("{fields}", assignments),
        {
            "id": operation.pk,
            "owner": owner[:255],
            "to_state": to_state,
            "reason": reason,
            **values,
        },
    )


#: The part both message statements share: the operation `old` locked -> succeeded, audited.
SUCCEEDED_FROM_OLD = f"""succeeded AS (
    UPDATE payments_operation AS op
    SET state = 'succeeded', next_attempt_at = NULL, updated_at = statement_timestamp()
    FROM old
    WHERE op.id = %(id)s AND op.id = old.id AND old.state = ANY(%(from_states)s)
    RETURNING {_columns(Operation, "op")}, old.state AS from_state
), audit AS (
    {AUDIT_INSERT}
    SELECT id, '', from_state, 'succeeded', %(actor)s::text, %(reason)s::text, statement_timestamp()
    FROM succeeded
)"""

#: A message's operation (pending | retrying | failed, ...) -> succeeded, audited; locks it.
SUCCEED_MESSAGE = f"""
WITH old AS (
    SELECT id, state FROM payments_operation WHERE id = %(id)s FOR UPDATE
), {SUCCEEDED_FROM_OLD}
SELECT {OPERATION_COLUMNS}, from_state FROM succeeded
"""


#: A message's first delivery: its inbox row (as inbox.services.record_message writes it)
#: and its operation -> succeeded, audited and locked, in one statement. A redelivery
#: (the row exists) changes nothing. Always one row: `recorded`, and the operation's
#: columns when it succeeded (NULL when its state may not succeed).
DELIVER_MESSAGE = f"""
WITH inbox AS (
    INSERT INTO {InboxEntry._meta.db_table} (consumer, message_id, handled_at)
    VALUES (%(consumer)s::text, %(message_id)s::text, %(handled_at)s)
    ON CONFLICT (consumer, message_id) DO NOTHING
    RETURNING id
), old AS (
    SELECT id, state FROM payments_operation
    WHERE id = %(id)s AND EXISTS (SELECT 1 FROM inbox)
    FOR UPDATE
), {SUCCEEDED_FROM_OLD}
SELECT {_columns(Operation, "s")}, s.from_state, EXISTS (SELECT 1 FROM inbox) AS recorded
FROM (SELECT 1) AS one LEFT JOIN succeeded AS s ON true
"""


@fence_writer
def deliver_message_in_tx(
    operation_id: int, *, consumer: str, message_id: str, actor: str, reason: str
) -> Operation | None:
    """Record a message's inbox row and mark its operation succeeded; return it, locked.

    One statement (DELIVER_MESSAGE) for what record_message and
    succeed_message_in_tx do in two. None: the inbox row exists (a
    redelivery), nothing changed. Raises as succeed_message_in_tx does when
    the operation may not succeed (the caller's transaction rolls back, the
    inbox row with it). In the caller's transaction (inbox.handlers.inbox_guard).
    """
    op = _one(
        Operation,
        DELIVER_MESSAGE,
        {
            "consumer": consumer,
            "message_id": message_id,
            "handled_at": timezone.now(),
            "id": operation_id,
            "from_states": transitions.operation_sources(OperationState.SUCCEEDED),
            "actor": actor[:255],
            "reason": reason,
        },
    )
    if not op.__dict__.pop("recorded"):
        return None
    if op.pk is None:
        _refuse_success(operation_id)
    return op


def _refuse_success(operation_id: int) -> NoReturn:
    """Raise why the operation may not succeed (IllegalTransition, or it changed meanwhile)."""
    current = Operation.objects.get(pk=operation_id)
    transitions.check_operation(current.key, current.state, OperationState.SUCCEEDED)
    raise InvalidTransition(f"operation {current.key} changed while it was delivered")


@fence_writer
def succeed_message_in_tx(operation_id: int, *, actor: str, reason: str) -> Operation:
    """Mark a message's operation succeeded and return it, locked. In the caller's transaction.

    One statement (SUCCEED_MESSAGE). Raises IllegalTransition when its state
    may not succeed (already succeeded, say): the caller's transaction rolls back.
    """
    op = _one(
        Operation,
        SUCCEED_MESSAGE,
        {
            "id": operation_id,
            "from_states": transitions.operation_sources(OperationState.SUCCEEDED),
            "actor": actor[:255],
            "reason": reason,
        },
    )
    if op is None:
        _refuse_success(operation_id)
    return op


def record_failed_attempt_in_tx(
    operation: Operation,
    *,
    actor: str,
    reason: str,
    give_up_to: OperationState = OperationState.FAILED,
) -> bool:
    """Count one failed attempt of the locked operation; return True when it gave up.

    Under MAX_ATTEMPTS the operation is RETRYING, due after the next backoff;
    at MAX_ATTEMPTS it goes to `give_up_to` (FAILED unless the caller knows an
    effect happened or may have). The lease is dropped either way. Runs inside
    the caller's transaction, on a row from locked_operation_in_tx (its clock).
    """
    attempt = operation.attempts + 1
    if attempt >= payments_settings().max_attempts:
        release_in_tx(
            operation,
            give_up_to,
            actor=actor,
            reason=f"gave up after {attempt} attempts: {reason}"[:500],
            attempts=attempt,
            last_error=reason,
        )
        return True
    delay = payments_settings().backoff_before(attempt)
    release_in_tx(
        operation,
        OperationState.RETRYING,
        actor=actor,
        reason=f"attempt {attempt} failed: {reason}"[:500],
        attempts=attempt,
        last_error=reason,
        next_attempt_at=clock_of(operation) + timedelta(seconds=delay),
    )
    return False


def holds_lease_in_tx(operation: Operation, owner: str) -> bool:
    """Tell whether `owner` still holds the lease of the locked operation."""
    return operation.state == OperationState.RUNNING and operation.lease_owner == owner


# --- claims --------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimResult:
    """The answer of a claim insert: the row, and whether this call inserted it."""

    claim: StepClaim
    created: bool


#: Insert a claim (none -> claimed, or done for a local step), audited; a taken step: nothing.
#: Claim a step (none -> claimed | done), audited; a step already claimed returns nothing.
INSERT_CLAIM = f"""
WITH inserted AS (
    INSERT INTO payments_stepclaim (
        operation_id, step, state, idempotency_key, provider_reference, request, result,
        error, attempts, claimed_by, claimed_at, last_request_at, lease_expires_at, settled_at,
        updated_at
    )
    VALUES (
        %(operation)s, %(step)s::text, %(state)s::text, %(idempotency_key)s::text, '',
        %(request)s::jsonb,
        %(result)s::jsonb, '', 1, %(owner)s::text, statement_timestamp(),
        -- the claimant sends its first request as this commits
        CASE WHEN %(idempotency_key)s::text <> '' THEN statement_timestamp() END,
        statement_timestamp() + make_interval(secs => %(lease_seconds)s),
        CASE WHEN %(state)s::text = 'done' THEN statement_timestamp() END, statement_timestamp()
    )
    ON CONFLICT ON CONSTRAINT {StepClaim.UNIQUE_CONSTRAINT} DO NOTHING
    RETURNING {CLAIM_COLUMNS}
), audit AS (
    {AUDIT_INSERT}
    SELECT operation_id, step, '', state, claimed_by, %(reason)s::text, statement_timestamp()
    FROM inserted
)
SELECT {CLAIM_COLUMNS} FROM inserted
"""

#: The same, for a claim sent ahead of its answer (queue_local_claim_in_tx): a step
#: already claimed fails the statement (a unique violation), so that nothing queued
#: behind it in its pipeline runs, its transaction's COMMIT included.
INSERT_CLAIM_OR_FAIL = INSERT_CLAIM.replace(
    f"ON CONFLICT ON CONSTRAINT {StepClaim.UNIQUE_CONSTRAINT} DO NOTHING\n", ""
)
if INSERT_CLAIM_OR_FAIL == INSERT_CLAIM:  # the ON CONFLICT clause above was reworded
    raise RuntimeError("INSERT_CLAIM_OR_FAIL must be INSERT_CLAIM without its ON CONFLICT")


def _claim_params(
    operation: Operation,
    step: str,
    *,
    state: ClaimState,
    owner: str,
    reason: str,
    lease_seconds: int | None = None,
    idempotency_key: str = "",
    request: dict[str, Any] | None = None,
    result: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The parameters of INSERT_CLAIM and INSERT_CLAIM_OR_FAIL for one claim."""
    return {
        "operation": operation.pk,
        "step": step,
        "state": state,
        "idempotency_key": idempotency_key,
        "request": _json(request),
        "result": _json(result),
        "owner": owner[:255],
        "lease_seconds": lease_seconds,
        "reason": reason,
    }


def _insert_claim(operation: Operation, params: dict[str, Any]) -> StepClaim | None:
    """Run INSERT_CLAIM with `_claim_params`; return the new claim (its operation attached),
    or None if taken."""
    claim = _one(StepClaim, INSERT_CLAIM, params)
    if claim is not None:
        claim.operation = operation
    return claim


def claim_step(
    operation: Operation,
    step: str,
    *,
    owner: str,
    lease_seconds: int,
    request: dict[str, Any] | None = None,
    provider_call: bool = True,
) -> ClaimResult:
    """Insert and COMMIT the claim of an external step; on conflict return the existing row.

    Must be called outside any transaction: the claim has to be durable before
    the external call it fences (the statement commits as it returns).
    `provider_call` derives and stores the provider idempotency key (not for
    effects that have none, like e-mail).
    """
    if transaction.get_connection().in_atomic_block:
        raise InvalidTransition("claim_step must commit before the external call; no atomic()")
    return claim_step_in_tx(
        operation,
        step,
        owner=owner,
        lease_seconds=lease_seconds,
        request=request,
        provider_call=provider_call,
    )


@fence_writer
def claim_step_in_tx(
    operation: Operation,
    step: str,
    *,
    owner: str,
    lease_seconds: int,
    request: dict[str, Any] | None = None,
    provider_call: bool = True,
) -> ClaimResult:
    """`claim_step` in the caller's transaction, which must commit before the call it fences.

    For a handler's open transaction (payments.engine.unit): the claim commits
    with the writes before it, then the call is made.
    """
    claim = _insert_claim(
        operation,
        _claim_params(
            operation,
            step,
            state=ClaimState.CLAIMED,
            owner=owner,
            reason="claimed",
            # the claimant acts at once (attempts 1); each take-over adds one
            lease_seconds=lease_seconds,
            idempotency_key=derive_idempotency_key(
                operation.key, step, operation.scope, operation.client_id
            )
            if provider_call
            else "",
            request=request,
        ),
    )
    if claim is not None:
        return ClaimResult(claim, created=True)
    existing = StepClaim.objects.select_related("operation").get(operation=operation, step=step)
    return ClaimResult(existing, created=False)


@fence_writer
def insert_local_claim_in_tx(
    operation: Operation, step: str, *, owner: str, result: dict[str, Any] | None = None
) -> StepClaim | None:
    """Insert the `done` claim of a local step; None when the step is taken already.

    Runs inside the transaction of the step's writes: a concurrent duplicate
    waits on the claim's unique key (ON CONFLICT) and, once the first
    commits, gets None. Before the writes (no `result` yet, stored after
    them), or after them with their `result` in the same statement.
    """
    return _insert_claim(
        operation,
        _claim_params(
            operation, step, state=ClaimState.DONE, owner=owner, reason="", result=result
        ),
    )


@fence_writer
def queue_local_claim_in_tx(
    operation: Operation, step: str, *, owner: str, result: dict[str, Any]
) -> None:
    """Queue the `done` claim of a local step whose writes ran, with their `result`.

    For a step that had no claim when the run's lease was taken (its
    function ran first): no answer is needed before the run goes on, so
    the claim goes in the pipeline of the transaction's next fence statement
    (a claim before a call, the release), or with its COMMIT
    (`send_queued_in_tx`): no round trip of its own. The claim commits with
    the writes or not at all. If another run committed the step meanwhile
    (a lease taken over), the claim fails there, nothing behind it runs, and
    that statement raises StepDoneMeanwhile. Runs inside the caller's
    transaction; its rollback must `discard_queued()`.
    """
    params = _claim_params(
        operation, step, state=ClaimState.DONE, owner=owner, reason="", result=result
    )
    _queue("queue_local_claim_in_tx", operation.key, step, INSERT_CLAIM_OR_FAIL, params)


def _queue(caller: str, operation_key: str, step: str, sql: str, params: dict[str, Any]) -> None:
    """Queue `sql` for the open transaction's next fence statement (see QueuedStatement)."""
    db = transaction.get_connection()
    if not db.in_atomic_block:
        raise InvalidTransition(f"{caller} must run inside transaction.atomic()")
    queued = QueuedStatement(operation_key, step, sql, params, db.atomic_blocks[-1])
    _QUEUED.set((*_QUEUED.get(), queued))


@fence_writer
def store_local_result_in_tx(claim: StepClaim, result: dict[str, Any]) -> None:
    """Store a local step's result on its claim. Runs inside the step's transaction."""
    StepClaim.objects.filter(pk=claim.pk).update(result=result)


def _locked_claim_in_tx(claim_id: int) -> StepClaim:
    """Return the claim locked FOR UPDATE (not its operation), with its operation and `db_now`."""
    return (
        StepClaim.objects.select_for_update(of=("self",))
        .select_related("operation")
        .annotate(db_now=Now())
        .get(pk=claim_id)
    )


def _name(claim: StepClaim) -> str:
    return f"{claim.operation.key}/{claim.step}"


def _require_owner(row: StepClaim, actor: str) -> None:
    """Refuse a settle or release by anyone but the claim's current owner (compare-and-set)."""
    if row.claimed_by != actor:
        logger.error(
            "claim %s is held by %s; %s may not change it (state %s)",
            _name(row),
            row.claimed_by or "nobody",
            actor,
            row.state,
        )
        raise NotClaimOwner(name=_name(row), owner=row.claimed_by, actor=actor)


@fence_writer
def take_over_claim(
    claim: StepClaim, *, owner: str, lease_seconds: int, why: str = ""
) -> StepClaim | None:
    """Take a claim to act on it; return the fresh row, or None while another owner holds it.

    A settled row (done, failed) is returned as it is, untaken: the caller
    replays its result or refuses, and never calls again. A claimed row whose
    owner did not release it (the owner died, or its job was cut off, between
    claim and record) becomes uncertain: that call may have run. A row its
    owner released after a transient failure stays claimed: nothing ran.
    Runs in its own transaction, or inside the caller's (then as a savepoint).
    """
    with transaction.atomic():
        row = _locked_claim_in_tx(claim.pk)
        if row.state in (ClaimState.DONE, ClaimState.FAILED):
            return row
        live = (
            row.lease_expires_at is not None
            and row.lease_expires_at > clock_of(row)
            and row.claimed_by not in ("", owner)
        )
        if live:
            return None
        previous, from_state = row.claimed_by, row.state
        in_doubt = row.state == ClaimState.CLAIMED and row.lease_expires_at is not None
        to_state = ClaimState.UNCERTAIN if in_doubt else row.state
        transitions.check_claim(_name(row), from_state, to_state)
        row.state = to_state
        row.claimed_by = owner
        row.lease_expires_at = clock_of(row) + timedelta(seconds=lease_seconds)
        row.attempts += 1
        row.save(
            update_fields=["state", "claimed_by", "lease_expires_at", "attempts", "updated_at"]
        )
        if previous != owner or row.state != from_state:
            record_event_in_tx(
                row.operation,
                step=row.step,
                from_state=from_state,
                to_state=row.state,
                actor=owner,
                reason=f"taken over from {previous or 'nobody'}"
                + ("; its call may have run" if row.state != from_state else "")
                + (f": {why}" if why else ""),
            )
    return row


#: claimed | uncertain (held by this actor) -> done | failed | uncertain, audited.
SETTLE_CLAIM_CHANGE = f"""
WITH old AS (
    SELECT id, state FROM payments_stepclaim WHERE id = %(id)s FOR UPDATE
), settled AS (
    UPDATE payments_stepclaim AS claim
    SET state = %(to_state)s::text,
        provider_reference = CASE WHEN %(reference)s <> '' THEN %(reference)s
                                  ELSE claim.provider_reference END,
        result = CASE WHEN %(set_result)s THEN %(result)s::jsonb ELSE claim.result END,
        error = %(error)s,
        lease_expires_at = NULL,
        settled_at = CASE WHEN %(to_state)s::text <> 'uncertain' THEN statement_timestamp()
                          ELSE claim.settled_at END,
        updated_at = statement_timestamp()
    FROM old
    WHERE claim.id = %(id)s AND claim.id = old.id AND old.state = ANY(%(from_states)s)
      AND claim.claimed_by = %(actor)s::text
    RETURNING {_columns(StepClaim, "claim")}, old.state AS from_state
), audit AS (
    {AUDIT_INSERT}
    SELECT operation_id, step, from_state, %(to_state)s::text, %(actor)s::text, %(reason)s::text,
           statement_timestamp()
    FROM settled
)
"""
SETTLE_CLAIM = SETTLE_CLAIM_CHANGE + f"SELECT {CLAIM_COLUMNS}, from_state FROM settled\n"

#: The same, for an outcome sent ahead of its answer (queue_outcome_in_tx): when it settles
#: nothing (the claim is not the actor's, or not in a state it may leave), the statement
#: fails (payments_fence_refuse, migration payments 0009), so that nothing queued behind
#: it in its pipeline runs, its transaction's COMMIT included.
SETTLE_CLAIM_OR_REFUSE = SETTLE_CLAIM_CHANGE + (
    "SELECT settled.* FROM (SELECT 1) AS one LEFT JOIN settled ON true\n"
    "WHERE CASE WHEN settled.id IS NOT NULL THEN true\n"
    "           ELSE payments_fence_refuse(%(refusal)s) END"
)
#: The SQLSTATE payments_fence_refuse() raises.
REFUSAL_SQLSTATE = "PF001"


@fence_writer
def settle_claim(
    claim: StepClaim,
    state: ClaimState,
    *,
    actor: str,
    reason: str = "",
    reference: str | None = None,
    result: dict[str, Any] | None = None,
    error: str = "",
) -> StepClaim:
    """Record a claim's outcome (done, failed, uncertain) with its reference, audited.

    Only the claim's current owner may settle it (compare-and-set on owner and
    state, through the transition table): anyone else gets NotClaimOwner or
    IllegalTransition and the row stays as it was. One statement
    (SETTLE_CLAIM): its own transaction, or the caller's.
    """
    if state == ClaimState.DONE:
        # Killed here, the outcome is not recorded: what a crash before the commit leaves.
        failpoint(BEFORE_RECORD_COMMIT)
    row = _settled(claim, _settle_params(claim, state, actor, reason, reference, result, error))
    if row is None:
        # Refused: say why, with the row as it is now (an illegal move, or another owner).
        current = StepClaim.objects.select_related("operation").get(pk=claim.pk)
        transitions.check_claim(_name(current), current.state, state)
        _require_owner(current, actor)
        raise NotClaimOwner(name=_name(current), owner=current.claimed_by, actor=actor)
    return row


@fence_writer
def settle_claim_again(
    claim: StepClaim,
    state: ClaimState,
    *,
    actor: str,
    reason: str = "",
    reference: str | None = None,
    result: dict[str, Any] | None = None,
) -> StepClaim | None:
    """settle_claim for an outcome queued in a transaction that rolled back: written on
    its own now, or, when the claim is no longer the actor's to settle (taken over,
    settled meanwhile), nothing: None, with a warning (its owner settles it)."""
    row = _settled(claim, _settle_params(claim, state, actor, reason, reference, result, ""))
    if row is None:
        logger.warning(
            "outcome of %s:%s not written again after a rollback: the claim is no longer "
            "%s's to settle",
            claim.operation.key,
            claim.step,
            actor,
        )
    return row


def _settled(claim: StepClaim, params: dict[str, Any]) -> StepClaim | None:
    """SETTLE_CLAIM with `params` (_settle_params): the settled row, or None (refused)."""
    row = _one(StepClaim, SETTLE_CLAIM, params)
    if row is not None:
        row.operation = claim.operation
    return row


def _settle_params(
    claim: StepClaim,
    state: ClaimState,
    actor: str,
    reason: str,
    reference: str | None,
    result: dict[str, Any] | None,
    error: str,
) -> dict[str, Any]:
    return {
        "id": claim.pk,
        "to_state": state,
        "from_states": transitions.claim_sources(state),
        "actor": actor[:255],
        "reference": reference or "",
        "set_result": result is not None,
        "result": _json(result),
        "error": error[:2000],
        "reason": reason or error[:500],
    }


def queue_outcome_in_tx(
    claim: StepClaim,
    state: ClaimState,
    *,
    actor: str,
    reason: str = "",
    reference: str | None = None,
    result: dict[str, Any] | None = None,
) -> None:
    """Queue a claim's outcome, known outside (a call answered, an e-mail sent), in the
    open transaction: settle_claim's change, sent ahead of its answer.

    Nothing waits for it: it goes in the pipeline of the transaction's next
    fence statement (the next claim before a call, the release), or with its
    COMMIT (`send_queued_in_tx`), in no round trip of its own, and commits
    with the transaction. If it settles nothing there (the claim was taken
    over, or settled by someone else meanwhile), that statement raises
    OutcomeRefused and nothing queued behind it runs, the COMMIT included.
    The caller writes the outcome again on its own (settle_claim_again) if the
    transaction rolls back (payments.engine.unit `record_outcome`). Runs inside
    the caller's transaction; its rollback must `discard_queued()`.
    """
    if state == ClaimState.DONE:
        # Killed here, the outcome is not recorded: what a crash before the commit leaves.
        failpoint(BEFORE_RECORD_COMMIT)
    key, step = claim.operation.key, claim.step
    params = _settle_params(claim, state, actor, reason, reference, result, "")
    params["refusal"] = (
        f"claim {key}:{step} was not settled {state} by {actor[:255]}: "
        "taken over, or settled by someone else meanwhile"
    )
    _queue("queue_outcome_in_tx", key, step, SETTLE_CLAIM_OR_REFUSE, params)


@fence_writer
def note_provider_view(claim: StepClaim, found: EffectResult | None, *, source: str) -> None:
    """Remember what the provider showed for a claim (None: not found). Not a state change."""
    view: dict[str, Any] = {"source": source, "checked_at": db_now().isoformat()}
    if found is None:
        view["status"] = "not_found"
    else:
        view.update({"outcome": str(found.outcome), "reference": found.reference, **found.data})
    StepClaim.objects.filter(pk=claim.pk).update(provider_view=view)
    claim.provider_view = view


#: A request goes out again under a claim's key (a replay, a confirm after a lost answer):
#: recorded before it is sent, by the database's clock, by the claim's owner only.
NOTE_REQUEST_SENT = """
UPDATE payments_stepclaim
SET last_request_at = statement_timestamp(), requests_sent = requests_sent + 1
WHERE id = %(id)s AND claimed_by = %(actor)s::text AND state IN ('claimed', 'uncertain')
RETURNING last_request_at
"""


@fence_writer
def note_request_sent(claim: StepClaim, *, actor: str) -> None:
    """Record, and commit, that `actor` is about to send a request under the claim's key again.

    "Not found at the provider" counts only a grace period after the last
    request sent, whoever sent it: a request that never reached the provider
    is executed by a later same-key replay, and a lookup soon after that
    replay cannot see what it did yet. Must run outside a transaction (Django's
    durable atomic refuses to nest): the time commits before the request leaves.
    """
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(NOTE_REQUEST_SENT, {"id": claim.pk, "actor": actor})
        row = cursor.fetchone()
    if row is None:
        raise InvalidTransition(f"{_name(claim)}: {actor} does not hold it; nothing is sent")
    claim.last_request_at = row[0]


def last_request_at(claim: StepClaim) -> datetime:
    """When the last request under the claim's key was sent (claims older than the column:
    when they were claimed)."""
    return claim.last_request_at or claim.claimed_at


_UNCHANGED: Any = object()


@fence_writer
def release_claim(
    claim: StepClaim, *, actor: str, reason: str, last_request_at: Any = _UNCHANGED
) -> None:
    """Drop a claim's lease after a transient failure: the next attempt may take it at once.

    Only its owner releases it; the owner stays recorded. Its state stays: a
    claimed row is then "released" (lease gone: nothing ran), an uncertain one
    stays uncertain (an earlier call may have run). `last_request_at` puts back
    the time of the request before one that was never sent.
    """
    with transaction.atomic():
        row = _locked_claim_in_tx(claim.pk)
        if row.state not in (ClaimState.CLAIMED, ClaimState.UNCERTAIN):
            return
        _require_owner(row, actor)
        row.lease_expires_at, row.error = None, reason[:2000]
        fields = ["lease_expires_at", "error", "updated_at"]
        if last_request_at is not _UNCHANGED:
            row.last_request_at = claim.last_request_at = last_request_at
            fields.append("last_request_at")
        row.save(update_fields=fields)
        record_event_in_tx(
            row.operation,
            step=row.step,
            from_state=row.state,
            to_state=row.state,
            actor=actor,
            reason=f"released after transient failure: {reason}"[:2000],
        )


def released_by(claim: StepClaim, owner: str) -> bool:
    """Tell whether `owner` claimed this step and released it after a refusal (nothing ran)."""
    return (
        claim.state == ClaimState.CLAIMED
        and claim.claimed_by == owner
        and claim.lease_expires_at is None
    )


def claim_carrying(reference: str, *, besides: StepClaim) -> str | None:
    """Name the other claim ("operation_key/step") settled done with `reference`, if any.

    One provider success settles one step. A failed claim may carry the same
    reference: an order's attempts share its PaymentIntent, and an attempt
    declined on it carries it as much as the one that succeeded.
    """
    if not reference:
        return None
    other = (
        StepClaim.objects.filter(provider_reference=reference, state=ClaimState.DONE)
        .exclude(pk=besides.pk)
        .select_related("operation")
        .first()
    )
    return None if other is None else f"{other.operation.key}/{other.step}"


def claim_expired(claim: StepClaim, now: datetime | None = None) -> bool:
    """Tell whether a CLAIMED row's owner is gone (lease released or run out, by the DB's clock)."""
    now = now or db_now()
    return claim.lease_expires_at is None or claim.lease_expires_at <= now
