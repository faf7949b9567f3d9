"""Database round trips, counted at the connection: statements, BEGIN, COMMIT, health checks.

What is counted, and why this way. A round trip is one message sequence that
waits for PostgreSQL's ReadyForQuery: a statement, a BEGIN, a COMMIT or
ROLLBACK, a health check. Statements are counted where psycopg's cursor
sends them (`psycopg.Cursor.execute`, patched while counting): what goes
through Django's cursors (SAVEPOINT and RELEASE included) and what is sent
on the psycopg connection itself, but not what a Django execute wrapper
keeps back (payments.engine.driver holds a SAVEPOINT for its block's first
statement and never sends its RELEASE). The counter adds what a cursor does
not send, where it happens:

- BEGIN: with Django's stock backend (the default) psycopg 3 sends it
  alone, a round trip of its own, when a statement is about to run with
  autocommit off and no transaction open (psycopg's `transaction_status`
  IDLE): counted so. The opt-in backend (project.postgresql,
  DATABASE_BEGIN_WITH_FIRST_STATEMENT=1) sends it itself, as a statement,
  in one pipeline with the transaction's first statement (alone first for a
  statement without parameters); the fence queues it in front of its own
  pipelines. Counted as it is sent, in `pipelined` when it shares a pipeline.
- COMMIT and ROLLBACK: Django calls the psycopg connection's `commit()` and
  `rollback()` from `DatabaseWrapper._commit` / `_rollback`; psycopg sends
  nothing when no transaction is open, so they count only when one is.
- Health checks: `is_usable()` runs `SELECT 1` on a raw psycopg cursor
  (CONN_HEALTH_CHECKS, once per job or request on a reused connection).
- Single-statement transactions: a data-modifying statement sent with
  autocommit on is a transaction of its own, committed as it returns, with
  no COMMIT of its own; `autocommits` counts them (they are statements, so
  not again in `total`), and `transactions` = `commits` + `autocommits` is
  the number of transactions the work committed.
- Prepares: the fence prepares its statements (payments.engine.driver,
  `statement_cursors`); psycopg sends a statement's Parse in a round trip of
  its own the first time a connection runs it. `prepares` counts those (in
  `total`): psycopg's own list of the connection's prepared statements grows.
  On kept connections they are paid once, not per checkout.
- Pipelines: the fence sends a statement together with the COMMIT that
  ends its transaction, the claims queued before it, the BEGIN it owes, or
  (outside a transaction) the lease with its entity's read (psycopg's
  pipeline mode, payments.engine.driver `execute`): they wait for one
  answer, at the pipeline's Sync. What goes in a pipeline is counted as
  usual (statement, BEGIN, COMMIT) and again in `pipelined`, which `total`
  subtracts; each pipeline adds one `syncs`. Its Parse goes with it too: no
  `prepares`. Outside a transaction a pipeline is one implicit transaction,
  committed at its end: one of `autocommits` if it writes.
- Connects are counted apart (`connects`) and not in `total`: opening a
  connection is several round trips (startup, authentication, SET TIME ZONE)
  paid once per connection, not per checkout (the bench keeps connections
  for 60 s, as production does).

A libpq protocol trace (psycopg's `pgconn.trace`) would see every message
itself, but it writes each one to a file from inside the measured path and is
lost on each reconnect; tests/devtools/test_bench_counters.py runs a fenced
checkout with both and checks that they agree, round trip for round trip.
`executemany` counts once (psycopg pipelines it); the ORM paths measured here
do not use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections
from psycopg import pq
from redis import Redis

#: A statement that only reads (a data-modifying CTE starts with WITH and counts as a write).
_READ_SQL = re.compile(r"\s*(SELECT|SHOW)\b", re.IGNORECASE)
_SAVEPOINT_SQL = re.compile(r"\s*(SAVEPOINT|RELEASE|ROLLBACK\s+TO)\b", re.IGNORECASE)
_COMMIT_SQL = re.compile(r"\s*COMMIT\s*$", re.IGNORECASE)
_BEGIN_SQL = re.compile(r"\s*BEGIN\b", re.IGNORECASE)

#: Redis hash (one per job function) where counting workers add up their jobs' trips.
KEY_PREFIX = "bench:db-round-trips:"


@dataclass
class RoundTrips:
    """Database round trips by kind; `total` is their sum (connects apart)."""

    statements: int = 0  # every statement a cursor sent, savepoints included
    savepoints: int = 0  # of which SAVEPOINT / RELEASE / ROLLBACK TO
    begins: int = 0
    commits: int = 0
    rollbacks: int = 0
    autocommits: int = 0  # of the statements, data-modifying ones sent with autocommit on
    prepares: int = 0  # a statement's first run on a connection: its Parse, one round trip
    health_checks: int = 0
    pipelined: int = 0  # of the above, sent in a pipeline: no round trip of their own
    syncs: int = 0  # a pipeline's one round trip
    deallocates: int = 0  # psycopg's DEALLOCATE ALL after a rollback of prepared statements
    connects: int = 0  # not round trips of the work: see the module's docstring
    #: Redis round trips of the work (RedisRoundTripCounter), not the database's: not in `total`.
    redis: int = 0
    jobs: int = 0

    @property
    def total(self) -> int:
        return (
            self.statements
            + self.prepares
            + self.begins
            + self.commits
            + self.rollbacks
            + self.health_checks
            + self.syncs
            + self.deallocates
            - self.pipelined
        )

    @property
    def transactions(self) -> int:
        """Transactions committed: COMMITs sent, and statements committed on their own."""
        return self.commits + self.autocommits

    def __sub__(self, other: RoundTrips) -> RoundTrips:
        return RoundTrips(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )

    def __add__(self, other: RoundTrips) -> RoundTrips:
        return RoundTrips(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def add(self, other: RoundTrips) -> None:
        """Add `other`'s counts to these, in place."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def per(self, n: int) -> dict[str, float]:
        """Every count divided by n, with the total: what one checkout costs."""
        values = {name: value / n for name, value in asdict(self).items() if name != "jobs"}
        values["total"] = self.total / n
        values["transactions"] = self.transactions / n
        return values


class RedisRoundTripCounter:
    """Count the Redis round trips of this process while installed (`trips`).

    redis-py waits for an answer once per command sent on its own
    (`Redis.execute_command`, and a pipeline's command while it WATCHes:
    `Pipeline.immediate_execute_command`) and once per pipeline sent
    (`Pipeline.execute` with commands queued, its MULTI/EXEC included): each
    is one round trip. A blocking pop counts as one too.
    """

    def __init__(self) -> None:
        self.trips = 0
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        from redis.client import Pipeline

        def counting(cls: Any, name: str, when: Callable[[Any], bool]) -> None:
            original = cls.__dict__[name]

            def wrapper(client: Any, *args: Any, **options: Any) -> Any:
                self.trips += when(client)
                return original(client, *args, **options)

            setattr(cls, name, wrapper)
            self._undo.append(lambda: setattr(cls, name, original))

        counting(Redis, "execute_command", lambda client: True)
        counting(Pipeline, "immediate_execute_command", lambda client: True)
        counting(Pipeline, "execute", lambda pipeline: bool(pipeline.command_stack))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


def _prepared_statements(raw: Any) -> int:
    """How many statements psycopg has prepared on this connection (its own bookkeeping)."""
    manager = getattr(raw, "_prepared", None)  # psycopg's PrepareManager: no public count
    return len(getattr(manager, "_names", ())) if manager is not None else 0


class RoundTripCounter:
    """Count the round trips of this thread's connection `alias` while installed."""

    def __init__(self, alias: str = DEFAULT_DB_ALIAS) -> None:
        self.alias = alias
        self.counts = RoundTrips()
        self._undo: list[Callable[[], None]] = []
        #: Whether the pipeline being sent holds a write (one implicit transaction).
        self._pipeline_wrote = False
        #: Inside a health check or a connect: their statements are theirs, not counted.
        self._quiet = False

    def snapshot(self) -> RoundTrips:
        return RoundTrips(**asdict(self.counts))

    def install(self) -> None:
        db = connections[self.alias]
        self._count_statements(db)
        self._patch(db, "_commit", self._ending(db, "commits"))
        self._patch(db, "_rollback", self._ending(db, "rollbacks"))
        self._patch(db, "is_usable", self._counting("health_checks"))
        self._patch(db, "connect", self._counting("connects"))
        self._count_pipelines(db)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _patch(
        self, db: Any, name: str, wrap: Callable[[Callable[[], Any]], Callable[[], Any]]
    ) -> None:
        original = getattr(db, name)
        setattr(db, name, wrap(original))  # an instance attribute: the class stays as it is
        self._undo.append(lambda: delattr(db, name))

    def _count_pipelines(self, db: Any) -> None:
        """Count one round trip (`syncs`) per pipeline this connection sends."""
        original = psycopg.Connection.pipeline
        counts = self.counts

        @contextmanager
        def pipeline(conn: Any) -> Iterator[Any]:
            ours = conn is db.connection
            if ours:
                self._pipeline_wrote = False
            try:
                with original(conn) as pipe:
                    yield pipe
            finally:  # a failed pipeline waited for its answer too
                counts.syncs += ours

        psycopg.Connection.pipeline = pipeline  # type: ignore[assignment,method-assign]

        def undo() -> None:
            psycopg.Connection.pipeline = original  # type: ignore[method-assign]

        self._undo.append(undo)

    def _count_statements(self, db: Any) -> None:
        """Count every statement psycopg sends on this connection, where psycopg's cursor
        sends it: what went through Django's cursors and what was sent on the psycopg
        connection itself (a savepoint held for its block's first statement,
        payments.engine.driver), never what a Django execute wrapper kept back."""
        execute, executemany = psycopg.Cursor.execute, psycopg.Cursor.executemany
        declare = psycopg.ServerCursor.execute  # its own, not Cursor's: a DECLARE

        def counted(send: Any, many: bool) -> Any:
            def sending(cursor: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
                if cursor.connection is not db.connection or self._quiet:
                    return send(cursor, query, params, **kwargs)
                sql = query if isinstance(query, str) else ""
                return self._execute(
                    lambda: send(cursor, query, params, **kwargs), db, sql, params, many
                )

            return sending

        psycopg.Cursor.execute = counted(execute, False)  # type: ignore[method-assign]
        psycopg.Cursor.executemany = counted(executemany, True)  # type: ignore[method-assign]
        psycopg.ServerCursor.execute = counted(declare, False)  # type: ignore[method-assign]

        def undo() -> None:
            psycopg.Cursor.execute = execute  # type: ignore[method-assign]
            psycopg.Cursor.executemany = executemany  # type: ignore[method-assign]
            psycopg.ServerCursor.execute = declare  # type: ignore[method-assign]

        self._undo.append(undo)

    def _execute(self, send: Callable[[], Any], db: Any, sql: str, params: Any, many: bool) -> Any:
        raw = db.connection
        piped = raw is not None and raw.pgconn.pipeline_status != pq.PipelineStatus.OFF
        if _BEGIN_SQL.match(sql):  # queued in front of a pipeline (payments.engine.fence)
            self.counts.begins += 1
            self.counts.pipelined += piped
            return send()
        if piped:
            # The pipeline's owner sent what a transaction needs first; outside one, the
            # pipeline is one implicit transaction, committed at its end, if it writes
            # (the lease with its entity's read, payments.engine.fence.acquire_lease).
            if db.get_autocommit() and not _READ_SQL.match(sql) and not self._pipeline_wrote:
                self.counts.autocommits += 1
                self._pipeline_wrote = True
        elif raw is not None and raw.info.transaction_status == pq.TransactionStatus.IDLE:
            # (project.postgresql sends the BEGIN it owes as a statement of its own, alone
            # or in a pipeline with the statement: counted above when it is sent.)
            if not raw.autocommit:
                # Django's stock backend: psycopg sends BEGIN first, in a round trip of its
                # own (in a pipeline too: it syncs the BEGIN before it queues the statement).
                self.counts.begins += 1
            elif not _READ_SQL.match(sql):
                self.counts.autocommits += 1  # its own transaction, committed as it returns
        if _COMMIT_SQL.match(sql):
            self.counts.commits += 1  # a COMMIT sent as a statement (the fence's, piped)
        else:
            self.counts.statements += 1
        self.counts.pipelined += piped
        if _SAVEPOINT_SQL.match(sql):
            self.counts.savepoints += 1
        prepared = _prepared_statements(raw)
        try:
            return send()
        finally:
            if _prepared_statements(raw) > prepared and not piped:
                self.counts.prepares += 1

    def _ending(self, db: Any, field: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
        def wrap(original: Callable[[], Any]) -> Callable[[], Any]:
            def ending() -> Any:
                raw = db.connection
                if raw is not None and raw.info.transaction_status != pq.TransactionStatus.IDLE:
                    setattr(self.counts, field, getattr(self.counts, field) + 1)
                prepared = _prepared_statements(raw)
                try:
                    return original()
                finally:
                    # psycopg forgets its prepared statements after a rollback and tells
                    # the server so (DEALLOCATE ALL): a round trip of its own.
                    if prepared and not _prepared_statements(db.connection):
                        self.counts.deallocates += 1

            return ending

        return wrap

    def _counting(self, field: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
        """Count a call of its own kind; the statements it sends are not counted again."""

        def wrap(original: Callable[[], Any]) -> Callable[[], Any]:
            def counted() -> Any:
                setattr(self.counts, field, getattr(self.counts, field) + 1)
                self._quiet = True
                try:
                    return original()
                finally:
                    self._quiet = False

            return counted

        return wrap


@contextmanager
def counting(alias: str = DEFAULT_DB_ALIAS) -> Iterator[RoundTripCounter]:
    """Count this thread's round trips on `alias` inside the block."""
    counter = RoundTripCounter(alias)
    counter.install()
    try:
        yield counter
    finally:
        counter.uninstall()


def record(redis: Redis, func_name: str, trips: RoundTrips) -> None:
    """Add one job's round trips to its function's hash (one Redis round trip)."""
    with redis.pipeline(transaction=False) as pipe:
        for name, value in asdict(trips).items():
            if value:
                pipe.hincrby(KEY_PREFIX + func_name, name, value)
        pipe.execute()


def recorded(redis: Redis) -> dict[str, RoundTrips]:
    """Return the round trips the counting workers recorded, by job function."""
    found = {}
    for key in redis.scan_iter(match=KEY_PREFIX + "*"):
        name = key.decode()[len(KEY_PREFIX) :]
        # A sync client: redis-py's annotations also allow the asyncio client's Awaitable.
        counts = cast("dict[bytes, bytes]", redis.hgetall(key))
        values = {k.decode(): int(v) for k, v in counts.items()}
        found[name] = RoundTrips(**values)
    return found
