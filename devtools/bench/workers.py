"""The bench's counting worker: FenceWorker that records each job's database round trips."""

from __future__ import annotations

from typing import Any

from devtools.bench.dbcount import RedisRoundTripCounter, RoundTripCounter, record
from payments.engine.worker import FenceWorker


class CountingWorker(FenceWorker):
    """Run jobs as FenceWorker does; add each job's round trips to Redis by job function.

    The count spans FenceWorker's own connection handling around the job (the
    health check of a reused connection included), so it is what one job
    costs the database, not only what the job function sends; and the job's
    Redis round trips (`redis`), RQ's handling of it included (its start and
    its end's pipeline), not the worker's wait for the next job.
    """

    counter: RoundTripCounter | None = None
    redis_counter: RedisRoundTripCounter | None = None

    def execute_job(self, job: Any, queue: Any) -> Any:
        if CountingWorker.counter is None:
            CountingWorker.counter = RoundTripCounter()
            CountingWorker.counter.install()
        if CountingWorker.redis_counter is None:
            CountingWorker.redis_counter = RedisRoundTripCounter()
            CountingWorker.redis_counter.install()
        before = CountingWorker.counter.snapshot()
        redis_before = CountingWorker.redis_counter.trips
        try:
            return super().execute_job(job, queue)
        finally:
            trips = CountingWorker.counter.snapshot() - before
            trips.redis = CountingWorker.redis_counter.trips - redis_before
            trips.jobs = 1
            record(self.connection, job.func_name, trips)
