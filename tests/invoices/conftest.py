"""The invoice export's fixtures: the fake accounting API over real HTTP, the app pointed at
it (beside the fake payment provider), and the environment of worker processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pytest_django import Settings

from devtools.fake_provider.accounting.server import FakeAccountingServer
from devtools.fake_provider.server import FakeProviderServer
from payments.invoices.names import ACCOUNTING, INVOICE_EXPORT
from payments.models import Operation
from tests.support.workers import worker_env

API_KEY = "acct_test_key"


@pytest.fixture
def fake_accounting() -> Iterator[FakeAccountingServer]:
    """The fake accounting API on a free port for one test (slow faults wait 3 s, over the
    tests' 1 s read timeout)."""
    with FakeAccountingServer(api_key=API_KEY, slow_delay=3.0) as server:
        yield server


@pytest.fixture
def accounting(
    fake_accounting: FakeAccountingServer, provider: FakeProviderServer, settings: Settings
) -> FakeAccountingServer:
    """The fake accounting API, with the app exporting paid orders to it."""
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "SYSTEMS": {ACCOUNTING: entry(fake_accounting)},
    }
    return fake_accounting


def entry(fake: FakeAccountingServer, **changes: object) -> dict[str, object]:
    """The settings entry of the accounting system, pointed at `fake`."""
    return {
        "URL": fake.url,
        "API_KEY": API_KEY,
        "OPTIONS": {"EXPORT_PAID_ORDERS": True},
        **changes,
    }


def accounting_env(provider: FakeProviderServer, fake: FakeAccountingServer, **extra: str):
    """A worker process's environment: the test database and Redis, both fakes."""
    return worker_env(
        provider.url,
        ACCOUNTING_URL=fake.url,
        ACCOUNTING_API_KEY=API_KEY,
        ACCOUNTING_EXPORT="1",
        **extra,
    )


def export_of(parent: Operation) -> Operation:
    """The paid order's export, written by the operation that paid it."""
    return Operation.objects.get(parent=parent, kind=INVOICE_EXPORT)
