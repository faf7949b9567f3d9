"""Upgrading to per-client keys keeps every earlier Idempotency-Key replayable."""

from __future__ import annotations

import json
from importlib import import_module
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from payments.engine.fence import fingerprint
from payments.engine.writes import fence_writes
from payments.models import ApiClient, ClientApiKey, Operation
from payments.shop.models import Order

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


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__an_order_keeps_the_client_of_its_first_operation(settings, monkeypatch):
    """A client from before 0012 (clients exist since 0006) keeps reaching its orders."""
    monkeypatch.setattr(import_module("payments.migrations.0013_order_owner_backfill"), "BATCH", 2)
    executor = MigrationExecutor(connection)
    executor.migrate([("payments", "0011_claim_last_request")])
    old = executor.loader.project_state([("payments", "0011_claim_last_request")]).apps
    old_order, old_operation = (
        old.get_model("payments", "Order"),
        old.get_model("payments", "Operation"),
    )
    shop = old.get_model("payments", "ApiClient").objects.create(name="shop-eu")
    orders = [
        old_order.objects.create(amount=100 + i, currency="eur", customer_email="u@example.com")
        for i in range(5)
    ]
    for key, order, client in [
        ("token-checkout", orders[1], None),  # API_TOKEN's path: the bootstrap client's
        ("shop-checkout", orders[3], shop),
        ("shop-refund", orders[4], shop),
    ]:
        old_operation.objects.create(
            key=key,
            scope="client",
            client=client,
            kind=key.partition("-")[2],
            entity_type="order",
            entity_id=str(order.pk),
            params={},
            fingerprint="x",
            state="succeeded",
        )
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    owners = dict(
        Order.objects.filter(pk__in=[o.pk for o in orders]).values_list("pk", "client__name")
    )
    assert [owners[o.pk] for o in orders] == ["bootstrap", "bootstrap", "bootstrap"] + [
        "shop-eu"
    ] * 2
    _, key = ClientApiKey.objects.create_key(name="k", client=ApiClient.objects.get(name="shop-eu"))
    shop_api = Client(headers={"Authorization": f"Bearer {key}"})
    assert shop_api.get(f"/api/orders/{orders[3].pk}").status_code == 200
    assert shop_api.get(f"/api/orders/{orders[0].pk}").status_code == 404


@pytest.mark.django_db  # sqlmigrate reads the applied migrations
def test_upgrade__0012_changes_payments_order_under_a_lock_timeout():
    """Its ALTER TABLEs fail fast behind a long transaction instead of queueing every order."""
    out = StringIO()
    call_command("sqlmigrate", "payments", "0012_order_client", stdout=out)
    lines = [line for line in out.getvalue().splitlines() if not line.startswith("--")]
    alters = [i for i, line in enumerate(lines) if line.startswith("ALTER TABLE")]
    sets = [i for i, line in enumerate(lines) if line.startswith("SET lock_timeout")]
    resets = [i for i, line in enumerate(lines) if line.startswith("RESET lock_timeout")]
    assert alters and sets and resets, lines
    assert sets[0] < alters[0] and alters[-1] < resets[0]
