"""Fixtures of the topology tests: a PgBouncer and a Redis master, replica and sentinels.

Each is a set of real processes on free ports of 127.0.0.1, started for one test
and stopped after it (devtools/topology/servers.py, which the chaos run's `--topology ha`
uses too; a missing binary skips the test, or fails it under make test).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection

from tests.support.topology import PgBouncer, RedisHA, binary


@pytest.fixture
def pgbouncer() -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling, one server connection, before the test database."""
    binary("pgbouncer")
    db = connection.settings_dict
    bouncer = PgBouncer(pg_host=db["HOST"] or "127.0.0.1", pg_port=int(db["PORT"] or 5432))
    try:
        yield bouncer.start()
    finally:
        bouncer.destroy()


@pytest.fixture
def redis_ha() -> Iterator[RedisHA]:
    """A Redis master, a replica and three sentinels watching them."""
    binary("redis-server")
    binary("redis-sentinel")
    cluster = RedisHA()
    try:
        yield cluster.start()
    finally:
        cluster.stop()
