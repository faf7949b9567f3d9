"""Tenancy: a client reaches only its own orders and operations; another's answer 404."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from payments.models import ApiClient, ClientApiKey, Operation
from payments.shop.models import Invoice, Order, OrderStatus

pytestmark = pytest.mark.django_db

TOKEN = "tenancy-token-that-is-long-enough-0123456789"


@pytest.fixture(autouse=True)
def _bootstrap_token(settings):  # noqa: PT004 - named for what it sets
    settings.API_TOKEN = TOKEN


def shop(name: str) -> Client:
    """A new API client with one key, as the admin or `create_api_client` makes it."""
    api_client = ApiClient.objects.create(name=name)
    _, key = ClientApiKey.objects.create_key(name=f"{name} key", client=api_client)
    return Client(headers={"Authorization": f"Bearer {key}"})


def post(client: Client, path: str, body: object, **headers: str):
    return client.post(
        path, data=json.dumps(body), content_type="application/json", headers=headers
    )


def new_order(client: Client) -> int:
    answer = post(client, "/api/orders", {"amount": 2000, "currency": "eur", "email": "a@x.io"})
    assert answer.status_code == 201, answer.content
    return int(answer.json()["id"])


def paid(order_id: int) -> Order:
    """Mark the order charged, as the checkout would have left it (invoice included)."""
    order = Order.objects.get(pk=order_id)
    Invoice.objects.create(
        order=order, number=f"INV-{order.pk}", amount=order.amount, currency="eur",
        provider_reference=f"pi_{order.pk}",
    )  # fmt: skip
    Order.objects.filter(pk=order_id).update(status=OrderStatus.PAID)
    return Order.objects.get(pk=order_id)


def snapshot(order_id: int) -> tuple:
    order = Order.objects.get(pk=order_id)
    return (order.status, order.refunded_amount, Operation.objects.count())


def test_orders__belong_to_the_client_that_created_them():
    shop_a = shop("shop-a")
    order_id = new_order(shop_a)
    assert Order.objects.get(pk=order_id).client == ApiClient.objects.get(name="shop-a")


def test_read__another_clients_order_is_404_and_shows_nothing():
    shop_a, shop_b = shop("shop-a"), shop("shop-b")
    order_id = new_order(shop_a)
    answer = shop_b.get(f"/api/orders/{order_id}")
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "order_not_found"
    assert "a@x.io" not in answer.content.decode()
    assert shop_a.get(f"/api/orders/{order_id}").status_code == 200


def test_read__counting_through_ids_finds_none_of_another_clients_orders():
    shop_a, shop_b = shop("shop-a"), shop("shop-b")
    ids = [new_order(shop_a) for _ in range(5)]
    unknown = max(ids) + 1000
    answers = {shop_b.get(f"/api/orders/{i}").content for i in [*ids, unknown]}
    assert [shop_b.get(f"/api/orders/{i}").status_code for i in ids] == [404] * 5
    # The same answer as an id that does not exist, except for the id it names.
    assert {json.loads(a)["error"]["code"] for a in answers} == {"order_not_found"}


def test_checkout__of_another_clients_order_is_404_and_changes_nothing(queue):
    shop_a, shop_b = shop("shop-a"), shop("shop-b")
    order_id = new_order(shop_a)
    before = snapshot(order_id)
    answer = post(
        shop_b,
        f"/api/orders/{order_id}/checkout",
        {"payment_method": "pm_card_visa"},
        **{"Idempotency-Key": "steal-1"},
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "order_not_found"
    assert snapshot(order_id) == before
    assert queue.count == 0


def test_refund__of_another_clients_order_is_404_and_changes_nothing(queue):
    shop_a, shop_b = shop("shop-a"), shop("shop-b")
    order_id = paid(new_order(shop_a)).pk
    before = snapshot(order_id)
    answer = post(
        shop_b, f"/api/orders/{order_id}/refunds", {"amount": 500}, **{"Idempotency-Key": "r-1"}
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "order_not_found"
    assert snapshot(order_id) == before
    assert queue.count == 0


def test_operation__of_another_client_is_404(queue):
    shop_a, shop_b = shop("shop-a"), shop("shop-b")
    order_id = new_order(shop_a)
    started = post(
        shop_a,
        f"/api/orders/{order_id}/checkout",
        {"payment_method": "pm_card_visa"},
        **{"Idempotency-Key": "mine"},
    )
    assert started.status_code == 202
    assert shop_b.get("/api/operations/mine").status_code == 404
    assert shop_a.get("/api/operations/mine").status_code == 200


def test_bootstrap__owns_orders_made_without_a_client():
    """Orders from before 0012, or made by the tools: the bootstrap client's, nobody else's."""
    order = Order.objects.create(amount=100, currency="eur", customer_email="t@x.io")
    bootstrap = Client(headers={"Authorization": f"Bearer {TOKEN}"})
    assert bootstrap.get(f"/api/orders/{order.pk}").status_code == 200
    assert shop("shop-b").get(f"/api/orders/{order.pk}").status_code == 404
