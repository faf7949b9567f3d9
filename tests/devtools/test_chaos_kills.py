"""The chaos run kills only workers that have started working, so a slow machine drains.

On a busy 2-core machine a worker takes longer to start than the time between kills:
killing starters left no worker to take the jobs. The rule reads RQ's own registration
(a worker's heartbeat) in the test Redis, from real `rq` Worker registrations.
"""

from __future__ import annotations

from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.worker import Worker

from devtools.chaos.run import started_workers
from devtools.topology.stack import Proc, free_port


def proc(name: str) -> Proc:
    return Proc(name, popen=None)  # type: ignore[arg-type]  # the rule reads the name only


def registered(redis_conn, name: str) -> Worker:
    worker = Worker(["payments"], connection=redis_conn, name=name)
    worker.register_birth()
    return worker


def test_worker_still_starting__is_not_killed(redis_conn):
    registered(redis_conn, "worker-1-1")
    ready, starting = proc("worker-1-1"), proc("worker-1-2")

    assert started_workers([ready, starting], redis_conn) == [ready]


def test_no_worker_started_yet__none_is_killed(redis_conn):
    assert started_workers([proc("worker-1-1"), proc("worker-1-2")], redis_conn) == []


def test_redis_flushed__a_worker_is_killable_again_after_its_next_heartbeat(redis_conn):
    worker = registered(redis_conn, "worker-1-1")
    redis_conn.flushdb()
    assert started_workers([proc("worker-1-1")], redis_conn) == []

    worker.heartbeat()

    assert [p.name for p in started_workers([proc("worker-1-1")], redis_conn)] == ["worker-1-1"]


def test_redis_unreachable__no_worker_is_killed():
    # No retries: redis-py's default backs off for seconds before it gives up.
    away = Redis(host="127.0.0.1", port=free_port(), retry=Retry(NoBackoff(), 0))
    assert started_workers([proc("worker-1-1")], away) == []
