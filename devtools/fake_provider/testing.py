"""What a test run against the fake provider sets: the app's short timeouts.

A module of its own, apart from the pytest plugin, so that tests' helpers (worker
processes' environment) import it without importing the plugin before pytest loads it.
"""

from __future__ import annotations

from typing import TypedDict


class PaymentsTimeouts(TypedDict):
    """The PAYMENTS settings a test against the fake provider runs with."""

    PROVIDER_CONNECT_TIMEOUT: float
    PROVIDER_READ_TIMEOUT: float
    JOB_TIMEOUT: int
    CLAIM_LEASE: int
    RETRY_BACKOFF: list[int]


#: Timeouts small enough for tests and still a valid chain (1.5 < 3 <= 3).
TEST_PAYMENTS: PaymentsTimeouts = {
    "PROVIDER_CONNECT_TIMEOUT": 0.5,
    "PROVIDER_READ_TIMEOUT": 1.0,
    "JOB_TIMEOUT": 3,
    "CLAIM_LEASE": 3,
    "RETRY_BACKOFF": [0, 0],
}
