"""The chaos run, small: real processes, provider faults, workers SIGKILLed, Redis flushed,
refunds through the API while workers keep dying, the provider's signed webhooks
(duplicated, reordered, delayed) to an endpoint that is SIGKILLed for a while, a shop
paying through a fake Adyen and every paid order exported to a fake accounting API."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command

from tests.support.workers import worker_env

# Transactional: the API server, the workers and the recovery loop are other
# processes that must see (and write) committed rows in the test database.
pytestmark = pytest.mark.django_db(transaction=True)


def test_chaos_run_with_webhooks_and_a_dropped_endpoint__no_double_charge_nothing_lost(
    provider, redis_conn, monkeypatch, tmp_path, settings
):
    settings.DEBUG = True  # a developer's machine: demo refuses to run otherwise
    provider.stop()  # the run starts its own provider with faults switched on
    for name, value in worker_env("http://unused").items():
        if name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "API_TOKEN"):
            monkeypatch.setenv(name, value)

    out = StringIO()
    call_command(
        "demo", orders=30, workers=2, kill_interval=(1.0, 3.0), seed=7, timeout=240,
        refund_rate=0.5, drop_rate=0.2, endpoint_down=3.0, output=str(tmp_path), stdout=out,
    )  # fmt: skip

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["violations"] == []
    assert report["orders"] == 30
    assert report["double_charges"] == 0
    assert report["provider_successes_without_claim"] == 0
    # A share of the orders paid through a shop on Adyen, judged by Adyen's own record.
    adyen = report["adyen"]
    assert adyen["orders"] >= 3
    assert adyen["adyen_double_charges"] == adyen["adyen_double_refunds"] == 0
    assert adyen["adyen_over_refunds"] == adyen["adyen_double_captures"] == 0
    assert adyen["adyen_payments_outside_the_fence"] == 0
    assert report["provider_successes"] == report["charge_claims_done"]
    assert report["provider_successes"] + adyen["adyen_payments_taken"] == report["orders_paid"]
    assert report["paid_orders_with_one_invoice"] == report["orders_paid"]
    assert report["paid_orders_with_one_ledger_line"] == report["orders_paid"]
    assert report["orders_paid"] + report["orders_declined_or_failed"] == 30
    # The invoice export, a third system under the same faults and kills: one invoice per
    # paid order at the accounting system's own list, none outside the fence.
    export = report["export"]
    assert export["double_invoices_any_operation"] == export["invoices_outside_the_fence"] == 0
    assert export["paid_orders_exported_once"] == report["orders_paid"]
    assert export["invoices_at_accounting"] == report["orders_paid"]
    # Refunds: a few, partial and full, each made once at the provider under its claim.
    assert report["refunds_asked"] >= 3
    assert report["refunds_refused_by_api"] == 0
    assert report["double_refunds"] == 0
    assert report["over_refunds"] == 0
    assert report["refunds_without_claim"] == 0
    assert report["refund_audit"]["clean"] is True
    assert report["refund_operations_by_state"] == {"succeeded": report["refunds_asked"]}
    assert report["refunds_succeeded"] == report["refunds_asked"]
    assert report["provider_refunds"] + adyen["adyen_refunds"] == report["refunds_succeeded"]
    assert report["refund_claims_done"] == report["refunds_succeeded"]
    assert report["credit_notes"] == report["refunds_succeeded"]
    assert report["orders_refunded"] + report["orders_partially_refunded"] >= 2
    assert report["orders_with_refunds"] == (
        report["orders_refunded"] + report["orders_partially_refunded"]
    )
    assert report["orders_with_refunds_matching"] == report["orders_with_refunds"]
    # Every refund the chaos left uncertain was settled without an operator.
    assert report["refunds_settled_automatically"] == report["refund_uncertain_outcomes"]
    # Charges: settled without a person, or by the reckless operator's presses, or parked
    # for review (their outcome still unknown, never shown failed).
    assert report["uncertain_outcomes"] == (
        report["uncertain_settled_automatically"]
        + report["uncertain_settled_by_an_operator"]
        + report["uncertain_left_for_review"]
    )
    # The reckless operator pressed, and the fence held.
    assert sum(report["reckless_presses"].values()) >= 1
    assert report["charged_but_failed_orders"] == 0
    assert report["live_payment_intents_per_order_max"] == 1
    assert report["workers_killed"] >= 1
    assert report["redis_flushed"] is True
    assert report["settled_in_time"] is True
    assert (tmp_path / "report.html").read_text().count("<svg") == 4
    # Webhooks: sent, some with faults, some refused while the endpoint was down, none
    # given up; the endpoint came back and the catch-up ran.
    assert report["webhooks"] is True
    assert report["webhook_events"] >= report["provider_successes"]
    assert report["webhook_failed_attempts"] >= 1
    assert report["webhook_gave_up"] == 0
    assert len(report["webhook_endpoint_outages_seconds"]) == 1
    assert report["webhook_catch_up"].startswith("Provider events since 1h")
    # Provider success -> operation settled, by cause and settler: figures, not their values.
    latency = report["success_to_settled_seconds"]
    for cause in ("answer_lost", "answer_late", "worker_killed"):
        for settler in ("provider_event", "catch_up", "reconciler", "worker_replay", "all"):
            figures = latency[cause][settler]
            assert set(figures) == {"count", "p50", "p95", "max"}
            assert (figures["p50"] is None) == (figures["count"] == 0)
    lost = latency["answer_lost"]
    assert lost["all"]["count"] >= 1
    assert isinstance(lost["all"]["p50"], float) and isinstance(lost["all"]["p95"], float)
    by_events = sum(latency[c][s]["count"] for c in latency for s in ("provider_event", "catch_up"))
    assert by_events >= 1  # some outcomes were settled by the provider's events
    assert report["successes_not_settled"] == 0
    printed = out.getvalue()
    assert "settled by a provider event (webhook)" in printed
    assert "settled by the reconciler" in printed
    assert " p95 " in printed
