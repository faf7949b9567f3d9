"""The fake provider's pytest plugin: a real HTTP fake provider per test.

Load it from a conftest.py (pytest-django's `settings` fixture must be available)::

    pytest_plugins = ["devtools.fake_provider.pytest_plugin"]

Fixtures:

- `fake_provider`: a `FakeProviderServer` on a free port of 127.0.0.1, started
  for the test and stopped after it. Its `url` is the base URL to call, its
  `state` the fake's in-memory state (queue faults, change the config with
  `fake_provider.state.configure()`).
- `provider`: the same server, with the app pointed at it for the test:
  `settings.PAYMENTS["PROVIDER_URL"]` is its URL, the timeouts are the short
  ones of `devtools.fake_provider.testing.TEST_PAYMENTS`, and e-mails are kept
  in memory (`django.core.mail.outbox`).

Both restore everything after the test: the server stops, pytest-django's
`settings` puts the settings back.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pytest_django import Settings

from devtools.fake_provider.server import FakeProviderServer
from devtools.fake_provider.testing import TEST_PAYMENTS


@pytest.fixture
def fake_provider() -> Iterator[FakeProviderServer]:
    """Start a fake provider on a free port for one test, then stop it.

    `slow` faults wait 1 s here (not 12 s): tests pair them with a client read
    timeout well below that. Change anything with `fake_provider.state.configure()`.
    """
    server = FakeProviderServer("127.0.0.1", 0, slow_delay=1.0).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def provider(fake_provider: FakeProviderServer, settings: Settings) -> FakeProviderServer:
    """The fake provider, with the app's settings pointing at it (and e-mails kept in memory)."""
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        **TEST_PAYMENTS,
        "PROVIDER_URL": fake_provider.url,
    }
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    return fake_provider
