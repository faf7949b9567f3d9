"""The one way to reach the payments queue's Redis: a client per process and URL, and the queue.

Every part of the app that talks to the queue's Redis (dispatch, recovery, the
desk, metrics, health, the deploy checks, the developer tools) asks here, so
that timeouts, pooling and the queue's name are decided once. Settings are
read on each call (django-rq freezes its own copy at import), so
`override_settings` and the test configuration apply. A queue entry with
SENTINELS (REDIS_SENTINELS) gets a client that asks the sentinels for the
master, as django-rq's `rqworker` does with the same entry.
"""

from __future__ import annotations

import functools
from typing import Any

import django_rq
from django.conf import settings
from redis import Redis
from redis.sentinel import Sentinel
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


@functools.cache
def _sentinel_client(
    sentinels: tuple[tuple[str, int], ...],
    master: str,
    db: int,
    username: str | None,
    password: str | None,
    sentinel_options: tuple[tuple[str, Any], ...],
    timeout: float | None,
) -> Redis:
    """The client of a master the sentinels name: each new connection asks them where it is.

    After a failover the old master's connections fail; the next command asks
    the sentinels again and reaches the promoted replica (redis-py's Sentinel
    connection pool), in this process's one pool per configuration.
    """
    options: dict[str, Any] = {"db": db, "username": username, "password": password}
    if timeout is not None:
        options.update(socket_connect_timeout=timeout, socket_timeout=timeout)
    sentinel = Sentinel(list(sentinels), sentinel_kwargs=dict(sentinel_options), **options)
    return sentinel.master_for(master, redis_class=Redis)


def redis_client(name: str | None = None, *, timeout: float | None = None) -> Redis:
    """Return this process's client for the Redis of queue `name` (default: payments).

    With `timeout`, connects and reads are bounded (probes, metrics); without,
    they wait as long as a worker's blocking pop needs.
    """
    config = queue_config(name)
    if "URL" in config:
        return _client(config["URL"], config.get("DB"), timeout)
    if "SENTINELS" in config:  # after URL, as django-rq decides (rqworker uses its choice)
        return _sentinel_client(
            tuple((str(host), int(port)) for host, port in config["SENTINELS"]),
            config["MASTER_NAME"],
            int(config.get("DB") or 0),
            config.get("USERNAME"),
            config.get("PASSWORD"),
            tuple(sorted(config.get("SENTINEL_KWARGS", {}).items())),
            timeout,
        )
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
