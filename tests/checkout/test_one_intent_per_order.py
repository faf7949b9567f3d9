"""One PaymentIntent per order: every attempt after the first confirms the order's intent.

Real workers in this process, real PostgreSQL and Redis, the fake provider over
HTTP. Transactional: a claim must commit before its call.
"""

from __future__ import annotations

import logging

import pytest

from payments.checkout.handler import request_checkout
from payments.checkout.names import CHARGE
from payments.checkout.orders import create_order
from payments.desk import services as desk
from payments.engine.writes import fence_writes
from payments.models import ApiClient, ClaimState, Operation, OperationState
from payments.shop.models import Order, OrderStatus
from tests.support.users import NEW_ATTEMPT, RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def declined_order(queue, *, key: str = "chk-1", client: ApiClient | None = None) -> Operation:
    """An order whose first checkout was declined (its intent is back in
    requires_payment_method, the order payment_failed)."""
    order = create_order(amount=2500, currency="eur", email="buyer@example.com", client=client)
    op, _ = request_checkout(
        order_id=order.pk, key=key, payment_method="pm_card_chargeDeclined", actor="api",
        client=client,
    )  # fmt: skip
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    return op


def test_a_new_key_after_a_decline__confirms_the_orders_intent(provider, queue):
    """Hole: the shop's retry with a new Idempotency-Key created a second PaymentIntent."""
    first = declined_order(queue)
    [intent] = provider.state.intents()

    second, _ = request_checkout(
        order_id=first.params["order_id"], key="chk-2", payment_method="pm_card_visa", actor="api"
    )
    run_worker(queue)

    assert [i["id"] for i in provider.state.intents()] == [intent["id"]]  # no second intent
    assert provider.state.intents()[0]["status"] == "succeeded"
    second.refresh_from_db()
    assert second.retry_of_id == first.pk  # the order's next attempt
    assert second.state == OperationState.SUCCEEDED
    claim = second.claims.get(step=CHARGE)
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, intent["id"])
    assert claim.request["payment_intent"] == intent["id"]
    assert Order.objects.get(pk=first.params["order_id"]).status == OrderStatus.PAID


def test_the_desks_new_attempt_after_a_decline__confirms_the_orders_intent(provider, queue):
    first = declined_order(queue)
    senior = make_user("sam", *VIEW, RECONCILE, NEW_ATTEMPT)

    new = desk.start_new_attempt(
        first, user=senior, reason="new card", payment_method="pm_card_visa"
    )
    run_worker(queue)

    [intent] = provider.state.intents()
    assert intent["status"] == "succeeded"
    assert provider.state.stats()["confirm_requests"] == 1
    new.refresh_from_db()
    assert new.state == OperationState.SUCCEEDED
    assert new.claims.get(step=CHARGE).provider_reference == intent["id"]


def test_a_confirm_the_intent_refuses_because_it_succeeded__never_charges_again(
    provider, queue, caplog
):
    """The provider itself refuses a second success: a later attempt on an intent that succeeded
    (its first attempt recorded failed by a bug) is recorded as that one charge, once."""
    order = create_order(amount=2500, currency="eur", email="buyer@example.com")
    first, _ = request_checkout(
        order_id=order.pk, key="chk-1", payment_method="pm_card_visa", actor="api"
    )
    provider.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    [intent] = provider.state.intents()
    assert intent["status"] == "succeeded"
    with fence_writes():  # hand-made state: the bug this test is about
        first.claims.filter(step=CHARGE).update(
            state=ClaimState.FAILED, provider_reference=intent["id"], result={"status": "declined"}
        )
        Operation.objects.filter(pk=first.pk).update(state=OperationState.FAILED)
        Order.objects.filter(pk=order.pk).update(status=OrderStatus.PAYMENT_FAILED)

    second, _ = request_checkout(
        order_id=order.pk, key="chk-2", payment_method="pm_card_visa", actor="api"
    )
    with caplog.at_level(logging.ERROR, logger="payments.alerts"):
        run_worker(queue)

    assert provider.state.stats()["confirm_requests"] == 1  # it was asked, and refused
    assert any("had succeeded already" in r.getMessage() for r in caplog.records)
    assert provider.state.succeeded_count() == 1
    assert len(provider.state.intents()) == 1
    second.refresh_from_db()
    assert second.claims.get(step=CHARGE).provider_reference == intent["id"]
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID


def test_two_clients_with_the_same_key__each_gets_its_own_provider_key_and_charge(provider, queue):
    """Hole: the provider idempotency key hashed only scope, key and step; shop B's checkout
    with shop A's key (their own order number) got idempotency_error and needs_review."""
    shop_a, shop_b = ApiClient.objects.create(name="a"), ApiClient.objects.create(name="b")
    ops = []
    for shop in (shop_a, shop_b):
        order = create_order(amount=2500, currency="eur", email="buyer@example.com", client=shop)
        op, _ = request_checkout(
            order_id=order.pk, key="order-1001", payment_method="pm_card_visa", actor="api",
            client=shop,
        )  # fmt: skip
        ops.append(op)

    run_worker(queue)

    keys = set()
    for op in ops:
        op.refresh_from_db()
        assert op.state == OperationState.SUCCEEDED, op.last_error
        keys.add(op.claims.get(step=CHARGE).idempotency_key)
    assert len(keys) == 2
    assert provider.state.succeeded_count() == 2
    assert provider.state.stats()["idempotency_conflicts"] == 0
