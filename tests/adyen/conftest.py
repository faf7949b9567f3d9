"""Fixtures of the Adyen tests: the fake Adyen over HTTP, its settings, a shop paying there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.fake_provider.adyen.server import FakeAdyenServer
from devtools.fake_provider.testing import TEST_PAYMENTS
from tests.support.adyen import API_KEY, ENDPOINT, HMAC_KEY, MERCHANT, Catcher, settings_entry


@pytest.fixture
def notes() -> Iterator[Catcher]:
    catcher = Catcher()
    yield catcher
    catcher.stop()


@pytest.fixture
def adyen(notes: Catcher, settings) -> Iterator[FakeAdyenServer]:
    """The fake Adyen, its notifications caught by `notes`, the app's settings pointing at it."""
    server = FakeAdyenServer(
        api_key=API_KEY,
        merchant_accounts=[MERCHANT],
        slow_delay=1.0,
        notification_url=notes.url,
        hmac_key=HMAC_KEY,
        notification_options={"retry_delays": [0.05], "timeout": 2.0},
    ).start()
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        **TEST_PAYMENTS,
        "SYSTEMS": {"adyen": settings_entry(server.checkout_url)},
    }
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    yield server
    server.stop()


@pytest.fixture
def adyen_to_app(live_server, settings) -> Iterator[FakeAdyenServer]:
    """The fake Adyen, its notification URL the app's endpoint on a live server."""
    server = FakeAdyenServer(
        api_key=API_KEY,
        merchant_accounts=[MERCHANT],
        notification_url=f"{live_server.url}{ENDPOINT}",
        hmac_key=HMAC_KEY,
        notification_options={"retry_delays": [0.05], "timeout": 5.0},
    ).start()
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        **TEST_PAYMENTS,
        "SYSTEMS": {"adyen": settings_entry(server.checkout_url)},
    }
    yield server
    server.stop()
