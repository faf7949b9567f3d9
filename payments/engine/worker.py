"""The default RQ worker class: SimpleWorker with healthy Django connections.

The forking Worker pays a fork and a new PostgreSQL connection per job
(`make bench` compares the two: docs/benchmarks.md), and the chaos run proves
the fence with this class. SimpleWorker runs the job in the worker process itself, so a
SIGKILL of the worker also ends its job: there is no orphaned work horse.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

from django.db import InterfaceError, OperationalError, close_old_connections, connection
from django.db.migrations.loader import MigrationLoader
from rq.worker import SimpleWorker

from payments.engine import fence
from payments.engine.handlers import unknown_recorded_names

logger = logging.getLogger("payments.engine.worker")

#: Seconds since the previous job ended cleanly within which the next job's connection
#: skips Django's health check (CONN_HEALTH_CHECKS' `SELECT 1`).
HEALTH_CHECK_AFTER_IDLE = 1.0

#: Seconds a starting worker waits for its database (a PostgreSQL or PgBouncer restart)
#: before it gives up and exits.
DATABASE_PATIENCE = 120.0


class FenceWorker(SimpleWorker):
    """Run each job in-process; drop broken or expired DB connections around it.

    Before it takes a job it waits until every payments and inbox migration
    is applied (this release's fence may need what they add; up to
    MIGRATIONS_PATIENCE), and checks that every kind and step name recorded
    on unfinished operations is known to this deploy's handlers
    (payments.E010), refusing to start otherwise: a renamed step would derive
    a new idempotency key for a step that already ran. A worker started while
    the database is away (a restart) waits for it too, instead of exiting: a
    supervisor that restarts it quickly would soon give up on it for good.
    """

    def work(self, *args: Any, **kwargs: Any) -> bool:
        pending = wait_for_migrations()
        if pending:
            for name in pending:
                logger.error("worker not started: migration %s is not applied", name)
            raise SystemExit(
                f"{len(pending)} payments/inbox migrations are not applied "
                f"({', '.join(pending)}) after {MIGRATIONS_PATIENCE:.0f} s: run "
                "`manage.py migrate`; this release's workers need them (see CHANGELOG.md, Upgrade notes)"
            )
        problems = recorded_name_problems()
        if problems:
            for problem in problems:
                logger.error("worker not started: %s, but no handler declares it", problem)
            raise SystemExit(
                "payments.E010: names recorded on unfinished operations are unknown to this "
                "deploy; see the log"
            )
        return bool(super().work(*args, **kwargs))

    _clean_until = 0.0  # monotonic time until which this worker's connection counts as fresh

    def execute_job(self, job: Any, queue: Any) -> Any:
        # Django does this around each request; a worker has no requests. A
        # connection that broke (PostgreSQL restarted) or outlived
        # CONN_MAX_AGE is replaced instead of failing the next job.
        close_old_connections()
        if time.monotonic() < self._clean_until:
            # The previous job used this connection without an error a moment
            # ago: a `SELECT 1` now would be one round trip per job for nothing
            # (3 per checkout). A connection that broke in between fails the
            # job's first statement, before anything changed; the job is
            # retried on a new connection, as after any database error.
            cast(Any, connection).health_check_done = True  # Django's flag (not in the stubs)
        try:
            return super().execute_job(job, queue)
        finally:
            abandon_open_transaction(job)
            close_old_connections()
            clean = connection.connection is not None and not connection.errors_occurred
            self._clean_until = time.monotonic() + HEALTH_CHECK_AFTER_IDLE if clean else 0.0


def abandon_open_transaction(job: Any) -> None:
    """Roll back and close a connection a job left inside a transaction; say so loudly.

    The runtime ends every transaction it opens, even on a timeout; this is
    the last line if one is ever left open. Closing it rolls it back on the
    server; Django's bookkeeping of the atomic blocks is reset, or it would
    refuse to reconnect ("the connection is closed") for every later job.
    """
    fence.discard_queued()  # local claims queued for that transaction go with it
    if not connection.in_atomic_block:
        return
    logger.error("job %s left a transaction open; rolled back, connection closed", job.id)
    connection.in_atomic_block = False
    connection.atomic_blocks = []
    connection.savepoint_ids = []
    connection.needs_rollback = False
    connection.closed_in_transaction = False
    connection.commit_on_exit = True
    connection.close()


#: The apps whose schema a worker relies on: it takes no job until their migrations ran.
WORKER_APPS = ("payments", "inbox")

#: Seconds a starting worker waits for `migrate` to apply them (a deploy's index builds
#: may take long), looking every MIGRATIONS_POLL seconds, before it exits.
MIGRATIONS_PATIENCE = 3600.0
MIGRATIONS_POLL = 5.0


def wait_for_migrations() -> list[str]:
    """Wait until every payments and inbox migration is applied; [] then, else (after
    MIGRATIONS_PATIENCE seconds) the ones still missing. Says so once a minute."""
    deadline = time.monotonic() + MIGRATIONS_PATIENCE
    said = 0.0
    while True:
        pending = pending_migrations()
        now = time.monotonic()
        if not pending or now >= deadline:
            return pending
        if now - said >= 60.0:
            said = now
            logger.warning("worker waiting for `migrate`: %s not applied yet", ", ".join(pending))
        time.sleep(min(MIGRATIONS_POLL, max(deadline - now, 0.0)))


def pending_migrations(patience: float = DATABASE_PATIENCE) -> list[str]:
    """The payments and inbox migrations not applied to the database yet, once it answers.

    A worker of a new release may need what they add (payments 0009 adds the
    function the fence's queued outcomes call): it must not take jobs before.
    """
    return _once_the_database_answers(patience, _pending_migrations)


def _pending_migrations() -> list[str]:
    loader = MigrationLoader(connection)
    graph = loader.graph
    # Every migration the apps' leaves need, in the order `migrate` applies them, once.
    plan = dict.fromkeys(
        node
        for leaf in graph.leaf_nodes()
        if leaf[0] in WORKER_APPS
        for node in graph.forwards_plan(leaf)
    )
    return [
        f"{app}.{name}"
        for app, name in plan
        if app in WORKER_APPS and (app, name) not in loader.applied_migrations
    ]


def recorded_name_problems(patience: float = DATABASE_PATIENCE) -> list[str]:
    """`unknown_recorded_names()`, once the database answers (up to `patience` seconds)."""
    return _once_the_database_answers(patience, unknown_recorded_names)


def _once_the_database_answers(patience: float, read: Callable[[], list[str]]) -> list[str]:
    """`read()`, retried while the database does not answer (up to `patience` seconds)."""
    deadline = time.monotonic() + patience
    pause = 0.5
    while True:
        try:
            return read()
        except (OperationalError, InterfaceError) as exc:
            connection.close()  # a new connection for the next attempt
            if time.monotonic() + pause > deadline:
                raise
            logger.warning("worker not started yet: waiting for the database (%s)", exc)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)
