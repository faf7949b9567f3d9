"""Where the tests run: their Redis database and the short timeouts they use."""

from __future__ import annotations

import os

# The fake provider's plugin applies these to settings.PAYMENTS; worker processes get them too.
from devtools.fake_provider.testing import TEST_PAYMENTS

__all__ = ["TEST_PAYMENTS", "TEST_REDIS_URL"]

#: One Redis database for every test (payments queues and the inbox test queue), flushed
#: around each test that uses it. Give each concurrent run its own database.
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
