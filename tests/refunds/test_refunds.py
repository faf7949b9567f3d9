"""Refunds, the second operation: API, limits under concurrency, failures and reconciliation.

Transactional: claims commit before their provider calls, and the racing
requests use their own connections.
"""

from __future__ import annotations

import json
import threading

import pytest
from django.db import connection
from django.test import Client

from payments.checkout.orders import create_order
from payments.desk import services as desk
from payments.engine.recovery import reconcile
from payments.models import Operation, OperationState
from payments.provider.client import ProviderClient
from payments.refunds.handler import RefundNotAllowed, request_refund
from payments.shop.models import CreditNote, Order, OrderStatus
from tests.support import flows
from tests.support.users import make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def post_refund(client: Client, order: Order, amount, key: str):
    return client.post(
        f"/api/orders/{order.pk}/refunds",
        data=json.dumps({"amount": amount}),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )


def refunds_at_provider(provider, order: Order) -> list[dict]:
    return [
        r
        for r in provider.state.refunds(metadata={"order_id": str(order.pk)})
        if r["status"] == "succeeded"
    ]


def test_partial_then_full_refund__through_the_api(provider, queue, api):
    order = flows.paid_order(queue)
    client = api

    first = post_refund(client, order, 500, "refund-1")
    assert first.status_code == 202, first.content
    assert first.json()["amount"] == 500
    run_worker(queue)
    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.PARTIALLY_REFUNDED, 500)

    rest = post_refund(client, order, 1500, "refund-2")
    assert rest.status_code == 202
    run_worker(queue)
    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.REFUNDED, 2000)
    assert CreditNote.objects.filter(order=order).count() == 2
    assert sum(r["amount"] for r in refunds_at_provider(provider, order)) == 2000
    assert client.get(f"/api/orders/{order.pk}").json()["refunded_amount"] == 2000


def test_refund_request__replay_conflict_and_limits_answer_clearly(provider, queue, api):
    order = flows.paid_order(queue)
    client = api
    assert post_refund(client, order, 700, "same").status_code == 202

    replay = post_refund(client, order, 700, "same")
    assert replay.status_code == 202 and replay["Idempotent-Replayed"] == "true"
    conflict = post_refund(client, order, 800, "same")
    assert (conflict.status_code, conflict.json()["error"]["code"]) == (409, "idempotency_conflict")
    too_much = post_refund(client, order, 1301, "too-much")  # 700 asked already, 1300 left
    assert (too_much.status_code, too_much.json()["error"]["code"]) == (409, "refund_not_allowed")
    for bad in (0, -5, "10", True, None):
        answer = post_refund(client, order, bad, f"bad-{bad}")
        assert answer.status_code == 400, bad
    missing = post_refund(client, Order(pk=999_999), 1, "missing")
    assert missing.status_code == 404
    assert Operation.objects.filter(kind="refund").count() == 1


def test_refund_of_an_unpaid_order__is_refused(provider, queue):
    order = create_order(amount=900, currency="eur", email="x@example.com")
    with pytest.raises(RefundNotAllowed, match="nothing to refund"):
        request_refund(order_id=order.pk, key="early", amount=100, actor="t")


def test_two_refunds_racing_for_the_last_euro__one_wins(provider, queue):
    """Real separate connections behind a barrier: the order's lock lets one reserve it."""
    order = flows.paid_order(queue, amount=1000)
    request_refund(order_id=order.pk, key="most", amount=900, actor="t")
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def race(key: str) -> None:
        try:
            barrier.wait(timeout=10)
            request_refund(order_id=order.pk, key=key, amount=100, actor="t")
            outcomes.append("accepted")
        except RefundNotAllowed:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=race, args=(k,)) for k in ("last-a", "last-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)

    assert sorted(outcomes) == ["accepted", "refused"]
    run_worker(queue)
    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.REFUNDED, 1000)
    assert sum(r["amount"] for r in refunds_at_provider(provider, order)) == 1000


def test_refund_refused_by_the_provider__fails_cleanly_order_untouched(provider, queue):
    """The provider checks the limit again: all of it was refunded outside our fence."""
    order = flows.paid_order(queue)
    op, _ = request_refund(order_id=order.pk, key="refused", amount=500, actor="t")
    with ProviderClient.from_settings() as client:  # a refund made in the provider's dashboard
        client.create_refund(
            payment_intent=op.params["payment_intent"],
            amount=None,
            metadata={},
            idempotency_key="dashboard-refund",
        )

    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert op.claims.get(step="refund").state == "failed"
    assert (order.status, order.refunded_amount) == (OrderStatus.PAID, 0)
    assert not CreditNote.objects.filter(order=order).exists()


def test_uncertain_refund__is_reconciled_from_the_intents_refunds_once(provider, queue):
    order = flows.paid_order(queue)
    provider.state.enqueue_faults("drop_after_accept", 1)  # refunded; the answer is lost
    op, _ = request_refund(order_id=order.pk, key="lost-answer", amount=600, actor="t")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN

    report = reconcile()
    run_worker(queue)

    assert report.count("done") == 1
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert (order.status, order.refunded_amount) == (OrderStatus.PARTIALLY_REFUNDED, 600)
    assert len(refunds_at_provider(provider, order)) == 1
    assert CreditNote.objects.filter(order=order).count() == 1


def test_failed_refund__gets_a_new_attempt_from_the_desk(provider, queue):
    """The desk asks the refund handler's declarations: a new key, the same refund."""
    order = flows.paid_order(queue)
    provider.state.enqueue_faults("fail_before", 3)  # every try refused before executing
    op, _ = request_refund(order_id=order.pk, key="flaky", amount=400, actor="t")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    senior = make_user(
        "sam",
        "payments.view_operation",
        "payments.reconcile_operation",
        "payments.start_new_attempt",
    )

    new = desk.start_new_attempt(op, user=senior, reason="provider was down; customer waits")
    run_worker(queue)

    new.refresh_from_db()
    order.refresh_from_db()
    assert (new.kind, new.retry_of_id, new.state) == ("refund", op.pk, OperationState.SUCCEEDED)
    assert (order.status, order.refunded_amount) == (OrderStatus.PARTIALLY_REFUNDED, 400)
    assert len(refunds_at_provider(provider, order)) == 1


# --- fence_audit for refunds -----------------------------------------------------------


def _audit_json() -> tuple[dict, int]:
    import io

    from django.core.management import call_command
    from django.core.management.base import CommandError

    out = io.StringIO()
    try:
        call_command("fence_audit", "--format", "json", stdout=out)
    except CommandError as exc:
        return json.loads(out.getvalue()), exc.returncode
    return json.loads(out.getvalue()), 0


def test_fence_audit__refunds_clean_after_normal_refunds(provider, queue):
    order = flows.paid_order(queue)
    request_refund(order_id=order.pk, key="r1", amount=300, actor="t")
    run_worker(queue)

    report, code = _audit_json()

    assert code == 0, report
    assert report["refunds"]["clean"] is True
    assert (report["refunds"]["provider_refunds"], report["refunds"]["done_claims"]) == (1, 1)


def test_fence_audit__finds_a_double_refund_and_a_refund_outside_the_fence(provider, queue):
    order = flows.paid_order(queue)
    op, _ = request_refund(order_id=order.pk, key="r1", amount=300, actor="t")
    run_worker(queue)
    fenced = op.claims.get(step="refund").provider_reference
    with ProviderClient.from_settings() as client:  # the same step refunded again, no claim
        extra = client.create_refund(
            payment_intent=op.params["payment_intent"],
            amount=300,
            metadata={"operation_key": op.key, "step": "refund"},
            idempotency_key="a-refund-without-a-claim",
        ).id

    report, code = _audit_json()

    assert code == 1
    refunds = report["refunds"]
    assert refunds["double_refunds"] == [
        {"step": f"{op.key}/refund", "references": sorted([fenced, extra])}
    ]
    assert refunds["unfenced"] == [extra]
    assert report["clean"] is False


def test_refund_audit__refunds_above_the_charge_are_an_over_refund():
    from payments.observability.audit import audit_refunds
    from payments.provider.client import Refund
    from payments.provider.ledger import refund_entry

    refunds = [
        refund_entry(
            Refund(
                id=f"re_{i}", amount=600, currency="eur", payment_intent="pi_1", status="succeeded"
            )
        )
        for i in range(2)
    ]
    result = audit_refunds({"pi_1": refunds}, {"pi_1": 1000})
    assert result.over_refunds == {"pi_1": {"charged": 1000, "refunded": 1200}}
    assert not result.clean
