"""The default RQ worker class: SimpleWorker with healthy Django connections.

`make bench` measured the forking Worker (a fork and a new PostgreSQL
connection per job) several times slower than SimpleWorker for the fenced
checkout (see README, Benchmarks), and the chaos run proves the fence with
this class. SimpleWorker runs the job in the worker process itself, so a
SIGKILL of the worker also ends its job: there is no orphaned work horse.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import close_old_connections
from rq.worker import SimpleWorker

from payments.engine.handlers import unknown_recorded_names

logger = logging.getLogger("payments.engine.worker")


class FenceWorker(SimpleWorker):
    """Run each job in-process; drop broken or expired DB connections around it.

    Before it takes a job it checks that every kind and step name recorded on
    unfinished operations is known to this deploy's handlers (payments.E010),
    and refuses to start otherwise: a renamed step would derive a new
    idempotency key for a step that already ran.
    """

    def work(self, *args: Any, **kwargs: Any) -> bool:
        problems = unknown_recorded_names()
        if problems:
            for problem in problems:
                logger.error("worker not started: %s, but no handler declares it", problem)
            raise SystemExit(
                "payments.E010: names recorded on unfinished operations are unknown to this "
                "deploy; see the log"
            )
        return bool(super().work(*args, **kwargs))

    def execute_job(self, job: Any, queue: Any) -> Any:
        # Django does this around each request; a worker has no requests. A
        # connection that broke (PostgreSQL restarted) or outlived
        # CONN_MAX_AGE is replaced instead of failing the next job.
        close_old_connections()
        try:
            return super().execute_job(job, queue)
        finally:
            close_old_connections()
