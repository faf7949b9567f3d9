"""Run one real rq worker process on the test queue: ``python -m tests.support.inbox_worker URL``.

The tests arm a crash point and set ``INBOX_TEST_HARD_CRASH=1``, so the
handler SIGKILLs this process mid-job, as when a machine dies.
"""

from __future__ import annotations

import sys

import django


def main(redis_url: str) -> None:
    django.setup()
    from redis import Redis
    from rq import Queue, SimpleWorker

    from tests.support.inbox_jobs import QUEUE_NAME

    connection = Redis.from_url(redis_url)
    # A plain rq Queue: the worker only dequeues; identity was set at enqueue.
    SimpleWorker([Queue(QUEUE_NAME, connection=connection)], connection=connection).work(burst=True)


if __name__ == "__main__":
    main(sys.argv[1])
