"""Upgrading to per-client keys keeps every earlier Idempotency-Key replayable."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from payments.engine.fence import fingerprint
from payments.engine.writes import fence_writes
from payments.models import Operation, Order

TOKEN = "upgrade-token-that-is-long-enough-0123456789"
BEFORE = [("payments", "0007_provider_events")]
AFTER = [("payments", "0008_bootstrap_client_keys")]


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__an_operation_from_before_api_clients_replays_for_the_bootstrap_token(
    settings, queue
):
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    order = old.get_model("payments", "Order").objects.create(
        amount=1000, currency="eur", customer_email="u@example.com", status="processing"
    )
    old.get_model("payments", "Operation").objects.create(
        key="before-upgrade",
        scope="client",
        kind="checkout",
        entity_type="order",
        entity_id=str(order.pk),
        params={
            "order_id": order.pk,
            "amount": 1000,
            "currency": "eur",
            "payment_method": "pm_card_visa",
        },
        fingerprint="computed-below",
    )
    executor = MigrationExecutor(connection)
    executor.migrate(AFTER)
    executor.loader.build_graph()
    MigrationExecutor(connection).migrate(executor.loader.graph.leaf_nodes())

    op = Operation.objects.get(key="before-upgrade")
    assert op.client is not None and op.client.name == "bootstrap"
    with fence_writes():  # hand-made state: the fingerprint the old release would have stored
        Operation.objects.filter(pk=op.pk).update(
            fingerprint=fingerprint("checkout", "order", str(order.pk), op.params)
        )
    settings.API_TOKEN = TOKEN
    answer = Client(headers={"Authorization": f"Bearer {TOKEN}"}).post(
        f"/api/orders/{order.pk}/checkout",
        data=json.dumps({"payment_method": "pm_card_visa"}),
        content_type="application/json",
        headers={"Idempotency-Key": "before-upgrade"},
    )
    assert answer.status_code == 202, answer.content
    assert answer["Idempotent-Replayed"] == "true"
    assert Operation.objects.filter(key="before-upgrade").count() == 1


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__orders_from_before_0012_belong_to_the_bootstrap_client(settings):
    executor = MigrationExecutor(connection)
    executor.migrate([("payments", "0011_claim_last_request")])
    old = executor.loader.project_state([("payments", "0011_claim_last_request")]).apps
    old_order = old.get_model("payments", "Order")
    ids = [
        old_order.objects.create(amount=100 + i, currency="eur", customer_email="u@example.com").pk
        for i in range(3)
    ]
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    owners = set(Order.objects.filter(pk__in=ids).values_list("client__name", flat=True))
    assert owners == {"bootstrap"}
    settings.API_TOKEN = TOKEN
    bootstrap = Client(headers={"Authorization": f"Bearer {TOKEN}"})
    assert bootstrap.get(f"/api/orders/{ids[0]}").status_code == 200
