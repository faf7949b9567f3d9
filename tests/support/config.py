"""Where the tests run: their Redis database and the short timeouts they use."""

from __future__ import annotations

import os
import re

# The fake provider's plugin applies these to settings.PAYMENTS; worker processes get them too.
from devtools.fake_provider.testing import TEST_PAYMENTS

__all__ = ["TEST_CACHE_REDIS_URL", "TEST_PAYMENTS", "TEST_REDIS_URL"]


def _redis_url_of_this_runner(base: str, runner: str, below: int = 0) -> str:
    """The Redis database of one pytest-xdist runner (`gw0`, `gw1`...): the base's number
    less the runner's (and less `below`), so that runners in one `make test` never flush
    each other's queues. Outside xdist (no runner), the base itself (less `below`)."""
    index = (int(runner.removeprefix("gw")) if runner.startswith("gw") else 0) + below
    found = re.fullmatch(r"(.*/)(\d+)", base)
    if found is None or int(found[2]) < index:
        raise ValueError(f"TEST_REDIS_URL {base!r}: no Redis database number for runner {runner!r}")
    return f"{found[1]}{int(found[2]) - index}"


#: One Redis database for every test of a runner (payments queues and the inbox test queue),
#: flushed around each test that uses it. Give each concurrent run its own base database:
#: `make test` runs three runners, on this database and the two below it.
TEST_REDIS_URL = _redis_url_of_this_runner(
    os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
    os.environ.get("PYTEST_XDIST_WORKER", ""),
)

#: The cache of the processes a runner starts (REDIS_CACHE_URL, a database apart from the
#: queue's: payments.W004): its queue database less the number of runners, below every
#: runner's queue database, so that no runner flushes another's cache (with three runners
#: on 15, 14 and 13, their caches are 12, 11 and 10).
TEST_CACHE_REDIS_URL = _redis_url_of_this_runner(
    os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
    os.environ.get("PYTEST_XDIST_WORKER", ""),
    below=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
)
