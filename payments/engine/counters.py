"""Counters in the payments queue's Redis (HINCRBY), sent with the job that counted them.

A job on `FenceWorker` ends with one Redis pipeline of RQ's own (the job's
status and result, the worker's job counts). What the job counted while it
ran (its provider calls, its operations' state changes: see
payments.observability.metrics) is held and added to that pipeline: a
checkout's two counts cost no round trip of their own, and they are sent
when the job's end is. Outside such a job (a request, a command, the
forking Worker's work horse) a count goes at once. If RQ's pipeline fails
(Redis went away), the counts held go with the job's own bookkeeping: a lost
count is a smaller harm than a failed step, and none is ever sent twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from payments.engine.queues import PROBE_TIMEOUT, redis_client

#: A job holds at most this many counts; later ones go at once (a long reconciler pass).
MOST_HELD = 200


@dataclass
class Held:
    """The counts a job made (key, field, amount), and whether they rode RQ's pipeline."""

    counts: list[tuple[str, str, int]] = field(default_factory=list)
    added: bool = False


_held: ContextVar[Held | None] = ContextVar("payments_held_counts", default=None)


def counter_redis() -> Redis:
    """The queue's Redis client that keeps the counters, with probe timeouts."""
    return redis_client(timeout=PROBE_TIMEOUT)


def add(key: str, name: str, amount: int = 1) -> None:
    """HINCRBY `key` `name` `amount`: held for the running job's end, else sent now.

    Raises what the Redis client raises for a count sent now (the caller decides
    what a failed count means).
    """
    held = _held.get()
    if held is not None and not held.added and len(held.counts) < MOST_HELD:
        held.counts.append((key, name, amount))
        return
    counter_redis().hincrby(key, name, amount)


@contextmanager
def held_for_job() -> Iterator[Held]:
    """Hold the counts made inside the block (a job) instead of sending each one."""
    token = _held.set(Held())
    try:
        yield _held.get()  # type: ignore[misc]  # set just above
    finally:
        _held.reset(token)


def add_held_to(pipeline: Any, connection: Redis) -> None:
    """Add the running job's held counts to `pipeline` (RQ's end of the job) on
    `connection`, if that is the counters' Redis; they count as sent once it runs.
    Called again for a pipeline run again (RQ's WatchError loop), they are added again."""
    held = _held.get()
    if held is None or not held.counts or not same_redis(connection, counter_redis()):
        return
    for key, name, amount in held.counts:
        pipeline.hincrby(key, name, amount)
    held.added = True


def send_held(held: Held) -> None:
    """Send the counts that did not ride RQ's pipeline, in one round trip; forget them all."""
    counts, held.counts = ([] if held.added else held.counts), []
    if not counts:
        return
    with counter_redis().pipeline(transaction=False) as pipeline:
        for key, name, amount in counts:
            pipeline.hincrby(key, name, amount)
        pipeline.execute()


def same_redis(one: Redis, other: Redis) -> bool:
    """Tell whether two clients reach the same Redis database (server, or sentinels'
    master, and db number)."""
    return _where(one) == _where(other)


def _where(client: Redis) -> tuple[Any, ...]:
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    place = tuple(kwargs.get(k) for k in ("host", "port", "path", "db"))
    return (type(pool), getattr(pool, "service_name", None), *place)
