"""The default RQ worker class: SimpleWorker with healthy Django connections.

`make bench` measured the forking Worker (a fork and a new PostgreSQL
connection per job) several times slower than SimpleWorker for the fenced
checkout (see README, Benchmarks), and the chaos run proves the fence with
this class. SimpleWorker runs the job in the worker process itself, so a
SIGKILL of the worker also ends its job: there is no orphaned work horse.
"""

from __future__ import annotations

from typing import Any

from django.db import close_old_connections
from rq.worker import SimpleWorker


class FenceWorker(SimpleWorker):
    """Run each job in-process; drop broken or expired DB connections around it."""

    def execute_job(self, job: Any, queue: Any) -> Any:
        # Django does this around each request; a worker has no requests. A
        # connection that broke (PostgreSQL restarted) or outlived
        # CONN_MAX_AGE is replaced instead of failing the next job.
        close_old_connections()
        try:
            return super().execute_job(job, queue)
        finally:
            close_old_connections()
