"""The one way to reach the payments queue's Redis: a client per process and URL, and the queue.

Every part of the app that talks to the queue's Redis (dispatch, recovery, the
desk, metrics, health, the deploy checks, the developer tools) asks here, so
that timeouts, pooling and the queue's name are decided once. Settings are
read on each call (django-rq freezes its own copy at import), so
`override_settings` and the test configuration apply.
"""

from __future__ import annotations

import functools
from typing import Any

import django_rq
from django.conf import settings
from redis import Redis
from rq.queue import Queue

from payments.conf import payments_settings

#: Seconds to wait for Redis in a probe or a metric: a blackholed host must not hang it.
PROBE_TIMEOUT = 2.0


def queue_config(name: str | None = None) -> dict[str, Any]:
    """Return the RQ_QUEUES entry of `name` (default: the payments queue)."""
    return dict(settings.RQ_QUEUES[name or payments_settings().queue])


@functools.cache
def _client(url: str, db: int | None, timeout: float | None) -> Redis:
    """One connection pool per process, URL and timeout (redis-py resets it after a fork)."""
    options: dict[str, Any] = {}
    if db is not None:
        options["db"] = db
    if timeout is not None:
        options.update(socket_connect_timeout=timeout, socket_timeout=timeout)
    return Redis.from_url(url, **options)


def redis_client(name: str | None = None, *, timeout: float | None = None) -> Redis:
    """Return this process's client for the Redis of queue `name` (default: payments).

    With `timeout`, connects and reads are bounded (probes, metrics); without,
    they wait as long as a worker's blocking pop needs.
    """
    config = queue_config(name)
    if "URL" in config:
        return _client(config["URL"], config.get("DB"), timeout)
    return _client(
        f"redis://{config.get('HOST', 'localhost')}:{config.get('PORT', 6379)}",
        config.get("DB", 0),
        timeout,
    )


def payments_queue() -> Queue:
    """Return the payments queue on this process's Redis client."""
    name = payments_settings().queue
    return django_rq.get_queue(name, connection=redis_client(name))


def queue_index() -> int:
    """Return the payments queue's index in django-rq's admin pages (its URLs use it)."""
    return list(settings.RQ_QUEUES).index(payments_settings().queue)
