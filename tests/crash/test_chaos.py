"""The chaos run, small: real processes, provider faults, workers SIGKILLed, Redis flushed."""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command

from tests.support.workers import worker_env

# Transactional: the API server, the workers and the recovery loop are other
# processes that must see (and write) committed rows in the test database.
pytestmark = pytest.mark.django_db(transaction=True)


def test_chaos_run__no_double_charge_nothing_lost(
    provider, redis_conn, monkeypatch, tmp_path, settings
):
    settings.DEBUG = True  # a developer's machine: demo refuses to run otherwise
    provider.stop()  # the run starts its own provider with faults switched on
    for name, value in worker_env("http://unused").items():
        if name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "API_TOKEN"):
            monkeypatch.setenv(name, value)

    call_command(
        "demo", orders=30, workers=2, kill_interval=(1.0, 3.0), seed=7, timeout=240,
        output=str(tmp_path),
    )  # fmt: skip

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["violations"] == []
    assert report["orders"] == 30
    assert report["double_charges"] == 0
    assert report["provider_successes_without_claim"] == 0
    assert report["provider_successes"] == report["orders_paid"] == report["charge_claims_done"]
    assert report["paid_orders_with_one_invoice"] == report["orders_paid"]
    assert report["paid_orders_with_one_ledger_line"] == report["orders_paid"]
    assert report["orders_paid"] + report["orders_declined_or_failed"] == 30
    assert report["workers_killed"] >= 1
    assert report["redis_flushed"] is True
    assert report["settled_in_time"] is True
    assert (tmp_path / "report.html").read_text().count("<svg") == 3
