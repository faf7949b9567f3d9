"""The invoice export: a paid order's invoice made once at the accounting system, whatever
answer is lost.

Real PostgreSQL, real Redis, an RQ worker in this process and the fake accounting API over
real HTTP. Transactional: a claim commits before its call, and follow-ups are enqueued on
the commit that marks the order paid.
"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
import requests
from django.core.management import call_command
from django.db import transaction

from payments.engine import fence
from payments.engine.recovery import reconcile
from payments.engine.steps import replay_allowed
from payments.fence import create_follow_ups_in_tx
from payments.invoices.effect import external_id
from payments.invoices.names import ACCOUNTING, EXPORT, INVOICE_EXPORT
from payments.models import ClaimState, Operation, OperationEvent, OperationState
from payments.shop.models import Order
from tests.invoices.conftest import API_KEY, entry, export_of
from tests.support import builders, flows
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def paid(queue, key: str) -> tuple[Order, Operation]:
    """An order paid by its checkout; its follow-ups run by the same worker."""
    order, op = flows.order_and_checkout(key=key)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    return order, op


def claim_of(export: Operation):
    return export.claims.get(step=EXPORT)


def test_paid_order__its_invoice_exported_once__the_request_on_the_trail(accounting, queue):
    order, op = paid(queue, "exp-1")

    export = export_of(op)
    assert export.state == OperationState.SUCCEEDED
    (invoice,) = accounting.state.invoices(external_id=external_id(export))
    assert (invoice["total"], invoice["currency"], invoice["customer"]) == (
        order.amount,
        "eur",
        order.customer_email,
    )
    claim = claim_of(export)
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, invoice["id"])
    assert accounting.state.stats()["create_requests"] == 1
    sent = [r for e in OperationEvent.objects.filter(operation=export) for r in e.requests or []]
    assert [(r["method"], r["path"], r["status"]) for r in sent] == [("POST", "/v1/invoices", 201)]


def test_export_off__a_paid_order_writes_no_export(accounting, queue, settings):
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "SYSTEMS": {ACCOUNTING: entry(accounting, OPTIONS={})},
    }

    _, op = paid(queue, "exp-off")

    assert not Operation.objects.filter(parent=op, kind=INVOICE_EXPORT).exists()
    assert accounting.state.invoices() == []


def test_answer_dropped_after_the_201__settled_by_a_same_key_replay__one_invoice(accounting, queue):
    accounting.state.enqueue_faults("drop_after_commit")
    _, op = paid(queue, "exp-drop")
    export = export_of(op)
    assert (export.state, claim_of(export).state) == (
        OperationState.UNCERTAIN,
        ClaimState.UNCERTAIN,
    )

    reconcile()
    run_worker(queue)

    export.refresh_from_db()
    assert export.state == OperationState.SUCCEEDED
    (invoice,) = accounting.state.invoices(external_id=external_id(export))
    assert claim_of(export).provider_reference == invoice["id"]
    assert accounting.state.stats()["replays"] == 1


def test_500_after_commit__the_replay_gets_the_500_again__the_list_settles_it(accounting, queue):
    accounting.state.enqueue_faults("fail_after_commit")
    _, op = paid(queue, "exp-500")
    export = export_of(op)
    assert export.state == OperationState.UNCERTAIN  # a 5xx may have executed: never failed

    report = reconcile()
    run_worker(queue)

    assert report.count("done") == 1, report.outcomes
    export.refresh_from_db()
    assert export.state == OperationState.SUCCEEDED
    (invoice,) = accounting.state.invoices(external_id=external_id(export))
    claim = claim_of(export)
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, invoice["id"])
    stats = accounting.state.stats()
    assert (stats["replays"], stats["list_requests"]) == (1, 1)  # the 500 replayed; the list told


def test_same_key_other_body__a_conflict_for_review__never_a_second_invoice(
    accounting, queue, settings
):
    # The order paid with the export off; its export written afterwards, as a paid order's
    # follow-up, so that its key can be used first with another body.
    on = settings.PAYMENTS
    settings.PAYMENTS = {**on, "SYSTEMS": {ACCOUNTING: entry(accounting, OPTIONS={})}}
    order, op = paid(queue, "exp-conflict")
    settings.PAYMENTS = on
    params = {"order_id": order.pk, "amount": order.amount, "currency": "eur", "reference": "pi"}
    with transaction.atomic():
        create_follow_ups_in_tx(
            op, (INVOICE_EXPORT,), entity_type="order", entity_id=order.pk, params=params,
            actor="test",
        )  # fmt: skip
    export = export_of(op)
    key = fence.derive_idempotency_key(export.key, EXPORT, export.scope, export.tenant)
    squatter = requests.post(
        f"{accounting.url}/v1/invoices",
        json={
            "external_id": "someone-else",
            "customer": "c",
            "currency": "eur",
            "lines": [{"description": "other", "amount": 1}],
            "total": 1,
        },
        headers={"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": key},
        timeout=5,
    )
    assert squatter.status_code == 201

    run_worker(queue)

    export.refresh_from_db()
    assert export.state == OperationState.NEEDS_REVIEW
    assert claim_of(export).state != ClaimState.DONE
    assert "idempotency_key_reused" in export.last_error
    assert accounting.state.invoices(external_id=external_id(export)) == []
    assert len(accounting.state.invoices()) == 1  # the squatter's only
    assert accounting.state.stats()["conflicts"] == 1


def test_past_the_keys_retention__the_engine_never_replays__the_list_decides(
    accounting, queue, settings
):
    accounting.state.enqueue_faults("drop_after_commit")
    _, op = paid(queue, "exp-old")
    export = export_of(op)
    claim = claim_of(export)
    assert claim.state == ClaimState.UNCERTAIN
    # The deployment's contract: keys kept a minute; the claim's key was first used two
    # minutes ago, and the fake has forgotten it (a replay would make a second invoice).
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "SYSTEMS": {ACCOUNTING: entry(accounting, KEY_RETENTION=60)},
    }
    builders.backdate(claim, timedelta(minutes=2))
    claim.refresh_from_db()
    accounting.state.configure(key_retention=0)
    assert not replay_allowed(claim)
    creates = accounting.state.stats()["create_requests"]

    report = reconcile()
    run_worker(queue)

    assert report.count("done") == 1, report.outcomes
    assert accounting.state.stats()["create_requests"] == creates  # no replay was sent
    assert len(accounting.state.invoices(external_id=external_id(export))) == 1
    export.refresh_from_db()
    assert export.state == OperationState.SUCCEEDED


def test_wrong_api_key__401__the_export_fails_without_a_retry_or_an_invoice(
    accounting, queue, settings
):
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "SYSTEMS": {ACCOUNTING: entry(accounting, API_KEY="acct_rotated")},
    }

    _, op = paid(queue, "exp-401")

    export = export_of(op)
    assert export.state == OperationState.FAILED
    assert claim_of(export).state == ClaimState.FAILED
    assert "HTTP 401" in export.last_error
    assert accounting.state.stats()["create_requests"] == 0  # refused before it ran
    assert accounting.state.invoices() == []


def test_exported_order__the_fence_audit_stays_clean(accounting, queue):
    paid(queue, "exp-audit")
    out = io.StringIO()

    call_command("fence_audit", stdout=out)  # exit 1 (CommandError) on any finding

    assert len(accounting.state.invoices()) == 1


def test_key_in_flight__409_is_no_failure__settled_once_the_held_request_ends(accounting, queue):
    # The first request is held at the accounting system past the worker's read timeout;
    # the same-key replay meets 409 (in flight): nothing executed, nothing decided.
    accounting.state.enqueue_faults("hold")
    _, op = paid(queue, "exp-held")
    export = export_of(op)
    assert export.state == OperationState.UNCERTAIN

    reconcile()

    assert accounting.state.stats()["in_flight_rejections"] == 1
    export.refresh_from_db()
    assert export.state == OperationState.UNCERTAIN  # never failed, never a new key
    assert accounting.state.invoices() == []

    assert accounting.state.release() == 1  # the held request executes now
    reconcile(operation_ids=[export.pk])  # looked at now, not at its next look (backed off)
    run_worker(queue)

    export.refresh_from_db()
    assert export.state == OperationState.SUCCEEDED
    (invoice,) = accounting.state.invoices(external_id=external_id(export))
    assert claim_of(export).provider_reference == invoice["id"]
