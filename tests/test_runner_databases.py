"""Each pytest-xdist runner's Redis databases (tests/support/config.py) are its own.

A runner flushes its queue database around its tests; the processes it starts
(gunicorn, runserver: tests/hardening) keep their cache in another database.
The cache was the queue database plus one, which is the next runner's queues:
that runner's flush emptied the cache in the middle of a test.
"""

from __future__ import annotations

import pytest

from tests.support.config import _redis_url_of_this_runner

BASE = "redis://127.0.0.1:6379/15"


@pytest.mark.parametrize("runners", [1, 2, 3, 4])
def test_queues_and_caches_of_every_runner__are_different_databases(runners):
    names = [f"gw{i}" for i in range(runners)]
    queues = [_redis_url_of_this_runner(BASE, name) for name in names]
    caches = [_redis_url_of_this_runner(BASE, name, below=runners) for name in names]

    assert len(set(queues + caches)) == 2 * runners
    assert queues[:2] == [BASE, "redis://127.0.0.1:6379/14"][:runners]


def test_a_base_too_low_for_the_runners__is_refused_by_name():
    with pytest.raises(ValueError, match="TEST_REDIS_URL 'redis://127.0.0.1:6379/2'"):
        _redis_url_of_this_runner("redis://127.0.0.1:6379/2", "gw1", below=3)
