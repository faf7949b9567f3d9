"""Where the tests run: their Redis database and the short timeouts they use."""

from __future__ import annotations

import os

#: One Redis database for every test (payments queues and the inbox test queue), flushed
#: around each test that uses it. Give each concurrent run its own database.
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")

#: Timeouts small enough for tests and still a valid chain (1.5 < 3 <= 3).
TEST_PAYMENTS = {
    "PROVIDER_CONNECT_TIMEOUT": 0.5,
    "PROVIDER_READ_TIMEOUT": 1.0,
    "JOB_TIMEOUT": 3,
    "CLAIM_LEASE": 3,
    "RETRY_BACKOFF": [0, 0],
}
