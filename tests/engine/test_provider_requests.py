"""Every provider request is kept with what came back, in the audit row the fence writes anyway.

Transactional: the checkouts run in a real worker against the real fake provider
(a claim must commit before its call), and the reconciler reads what they committed.
"""

from __future__ import annotations

import re

import pytest

from payments.engine import exchanges
from payments.engine.recovery import look_up, reconcile
from payments.models import ClaimState, OperationEvent, OperationState, StepClaim
from payments.provider.client import ProviderClient
from tests.support import flows
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

REQUEST_ID = re.compile(r"^req_\w+$")


def charge_rows(op_key: str) -> list[OperationEvent]:
    return list(OperationEvent.objects.filter(operation__key=op_key, step="charge"))


def test_first_charge__its_done_row_carries_post_200_the_request_id_and_the_key(provider, queue):
    order = flows.paid_order(queue, key="req-paid")
    claim = StepClaim.objects.get(operation__key="req-paid", step="charge")

    done = OperationEvent.objects.get(operation__key="req-paid", step="charge", to_state="done")

    assert done.actor == claim.claimed_by  # who sent it: the worker
    (sent,) = done.requests
    assert (sent["method"], sent["path"], sent["status"]) == ("POST", "/v1/payment_intents", 200)
    assert REQUEST_ID.match(sent["request_id"])
    assert sent["idempotency_key"] == claim.idempotency_key
    # A row no request led to carries none; nor does a local step's.
    claimed = OperationEvent.objects.get(operation__key="req-paid", step="charge", reason="claimed")
    assert claimed.requests is None
    assert not OperationEvent.objects.filter(
        operation__entity_id=str(order.pk), step="invoice", requests__isnull=False
    ).exists()


def test_lost_answer_then_reconciler__no_answer_kept_and_the_replay_on_its_row(provider, queue):
    op = flows.uncertain_after_read_timeout(provider, queue, key="req-lost")
    (lost,) = [e for e in charge_rows(op.key) if e.to_state == ClaimState.UNCERTAIN]
    assert lost.requests == [
        {"method": "POST", "path": "/v1/payment_intents", "status": None,
         "idempotency_key": lost.requests[0]["idempotency_key"], "error": "ReadTimeout"}
    ]  # fmt: skip

    reconcile(actor="reconciler:test")
    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    (done,) = [e for e in charge_rows(op.key) if e.to_state == ClaimState.DONE]
    assert done.actor == "reconciler:test"
    (replay,) = done.requests
    assert (replay["status"], replay["replayed"]) == (200, True)
    assert REQUEST_ID.match(replay["request_id"])


def test_read_only_look_up__the_provider_view_keeps_its_requests_and_who_asked(provider, queue):
    order = flows.paid_order(queue, key="req-look")
    op = StepClaim.objects.get(operation__key="req-look", step="charge").operation

    with exchanges.recording():
        look_up(op, actor="operator:olga")
        left = exchanges.take()

    view = StepClaim.objects.get(operation=op, step="charge").provider_view
    assert view["actor"] == "operator:olga"
    (get,) = view["requests"]
    assert (get["method"], get["status"]) == ("GET", 200)
    assert get["path"] == f"/v1/payment_intents/{order.invoice.provider_reference}"
    assert left == view["requests"]  # still there for the caller's audit row


def test_requests_outside_a_recording__noted_nowhere(provider):
    with ProviderClient.from_settings() as client:
        found = list(client.list_payment_intents(limit=1))
        with exchanges.recording():
            list(client.list_payment_intents(limit=1))
            inside = exchanges.take()

    assert found == [] and exchanges.take() is None
    assert [(r["method"], r["path"], r["status"]) for r in inside or []] == [
        ("GET", "/v1/payment_intents", 200)
    ]
