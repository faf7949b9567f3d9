"""The synchronous JSON API: happy path, idempotent replay, every bad input, auth."""

from __future__ import annotations

import json
import threading

import pytest
from django.db import connection
from django.test import Client

from payments.models import Operation
from payments.shop.models import Order, OrderStatus
from tests.support.api import API_TOKEN, api_client

pytestmark = pytest.mark.django_db


def post(client: Client, path: str, body: object, **headers: str):
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", headers=headers)


def make_order(api: Client) -> int:
    response = post(
        api, "/api/orders", {"amount": 1999, "currency": "eur", "email": "a@example.com"}
    )
    assert response.status_code == 201, response.content
    return response.json()["id"]


def test_create_order__201_with_the_order(api):
    response = post(
        api, "/api/orders", {"amount": 1999, "currency": "EUR", "email": "a@example.com"}
    )
    assert response.status_code == 201
    body = response.json()
    assert body["amount"] == 1999
    assert body["currency"] == "eur"
    assert body["status"] == "pending"
    assert Order.objects.get(pk=body["id"]).customer_email == "a@example.com"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"currency": "eur", "email": "a@example.com"}, "amount"),
        ({"amount": -5, "currency": "eur", "email": "a@example.com"}, "amount"),
        ({"amount": 0, "currency": "eur", "email": "a@example.com"}, "amount"),
        ({"amount": 19.99, "currency": "eur", "email": "a@example.com"}, "amount"),
        ({"amount": "1999", "currency": "eur", "email": "a@example.com"}, "amount"),
        ({"amount": True, "currency": "eur", "email": "a@example.com"}, "amount"),
        ({"amount": 10**12, "currency": "eur", "email": "a@example.com"}, "amount"),
        ({"amount": 1999, "email": "a@example.com"}, "currency"),
        ({"amount": 1999, "currency": "xyz", "email": "a@example.com"}, "currency"),
        ({"amount": 1999, "currency": 978, "email": "a@example.com"}, "currency"),
        ({"amount": 1999, "currency": "eur"}, "email"),
        ({"amount": 1999, "currency": "eur", "email": "not-an-email"}, "email"),
    ],
)
def test_create_order__bad_input_is_400_naming_the_field_and_writes_nothing(api, body, field):
    response = post(api, "/api/orders", body)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == field
    assert not Order.objects.exists()


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", "", "\xff"])
def test_malformed_json__400(api, raw):
    response = post(api, "/api/orders", raw.encode("latin-1"))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "malformed_json"
    assert not Order.objects.exists()


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic abc", "Bearer "])
def test_auth__missing_or_wrong_token_is_401(settings, header):
    settings.API_TOKEN = API_TOKEN
    client = Client(headers={"Authorization": header} if header else {})
    response = post(client, "/api/orders", {"amount": 1, "currency": "eur", "email": "a@b.co"})
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert not Order.objects.exists()


def test_checkout__202_with_operation_then_same_key_replays_without_enqueuing_twice(
    api, queue, django_capture_on_commit_callbacks
):
    order_id = make_order(api)
    path = f"/api/orders/{order_id}/checkout"
    with django_capture_on_commit_callbacks(execute=True) as first_callbacks:
        first = post(api, path, {"payment_method": "pm_card_visa"}, **{"Idempotency-Key": "abc"})
    with django_capture_on_commit_callbacks(execute=True) as second_callbacks:
        second = post(api, path, {"payment_method": "pm_card_visa"}, **{"Idempotency-Key": "abc"})

    assert first.status_code == second.status_code == 202
    assert first.json() == {"operation": "abc", "state": "pending", "order": order_id}
    assert second.json()["operation"] == "abc"
    assert second["Idempotent-Replayed"] == "true"
    assert first_callbacks and not second_callbacks  # the replay schedules no enqueue
    assert queue.count == 1
    assert Order.objects.get(pk=order_id).status == OrderStatus.PROCESSING


def test_checkout__same_key_for_another_order_or_params_is_409(api, queue):
    first, second = make_order(api), make_order(api)
    headers = {"Idempotency-Key": "shared"}
    assert (
        post(
            api, f"/api/orders/{first}/checkout", {"payment_method": "pm_card_visa"}, **headers
        ).status_code
        == 202
    )
    other_order = post(
        api, f"/api/orders/{second}/checkout", {"payment_method": "pm_card_visa"}, **headers
    )
    other_params = post(
        api,
        f"/api/orders/{first}/checkout",
        {"payment_method": "pm_card_chargeDeclined"},
        **headers,
    )
    assert other_order.status_code == other_params.status_code == 409
    assert other_order.json()["error"]["code"] == "idempotency_conflict"
    assert "Idempotency-Key" in other_order.json()["error"]["message"]
    assert Operation.objects.count() == 1


def test_checkout__new_key_for_an_order_already_in_progress_is_409(api, queue):
    order_id = make_order(api)
    path = f"/api/orders/{order_id}/checkout"
    post(api, path, {"payment_method": "pm_card_visa"}, **{"Idempotency-Key": "one"})
    response = post(api, path, {"payment_method": "pm_card_visa"}, **{"Idempotency-Key": "two"})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "order_not_open"


@pytest.mark.parametrize(
    ("headers", "body", "field"),
    [
        ({}, {"payment_method": "pm_card_visa"}, "Idempotency-Key"),
        ({"Idempotency-Key": "   "}, {"payment_method": "pm_card_visa"}, "Idempotency-Key"),
        ({"Idempotency-Key": "k" * 256}, {"payment_method": "pm_card_visa"}, "Idempotency-Key"),
        ({"Idempotency-Key": "k"}, {}, "payment_method"),
        ({"Idempotency-Key": "k"}, {"payment_method": ""}, "payment_method"),
        ({"Idempotency-Key": "k"}, {"payment_method": 42}, "payment_method"),
    ],
)
def test_checkout__bad_input_is_400_and_writes_nothing(api, queue, headers, body, field):
    order_id = make_order(api)
    response = post(api, f"/api/orders/{order_id}/checkout", body, **headers)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == field
    assert not Operation.objects.exists()
    assert Order.objects.get(pk=order_id).status == OrderStatus.PENDING


def test_checkout__255_character_key_is_accepted(api, queue):
    order_id = make_order(api)
    response = post(
        api,
        f"/api/orders/{order_id}/checkout",
        {"payment_method": "pm_card_visa"},
        **{"Idempotency-Key": "k" * 255},
    )
    assert response.status_code == 202


def test_checkout__unknown_order_is_404(api, queue):
    response = post(
        api,
        "/api/orders/999999/checkout",
        {"payment_method": "pm_card_visa"},
        **{"Idempotency-Key": "k"},
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "order_not_found"
    assert not Operation.objects.exists()


def test_operation_detail__shows_state_and_steps(api, queue):
    order_id = make_order(api)
    post(
        api,
        f"/api/orders/{order_id}/checkout",
        {"payment_method": "pm_card_visa"},
        **{"Idempotency-Key": "show/me"},
    )
    response = api.get("/api/operations/show/me")
    assert response.status_code == 200
    body = response.json()
    assert body["operation"] == "show/me"
    assert body["state"] == "pending"
    assert body["steps"] == []
    assert api.get("/api/operations/nope").status_code == 404


def test_wrong_method__405(api):
    assert api.get("/api/orders").status_code == 405


# --- POST /api/orders with an Idempotency-Key ---------------------------------------------

ORDER = {"amount": 1999, "currency": "eur", "email": "a@example.com"}


def test_create_order__same_key_replays_the_order_instead_of_a_second_one(api):
    first = post(api, "/api/orders", ORDER, **{"Idempotency-Key": "order-1"})
    again = post(api, "/api/orders", ORDER, **{"Idempotency-Key": "order-1"})
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.json() == first.json()
    assert again["Idempotent-Replayed"] == "true" and not first.has_header("Idempotent-Replayed")
    assert Order.objects.count() == 1


def test_create_order__same_key_with_another_body_is_409_and_writes_nothing(api):
    post(api, "/api/orders", ORDER, **{"Idempotency-Key": "order-1"})
    other = post(api, "/api/orders", {**ORDER, "amount": 2000}, **{"Idempotency-Key": "order-1"})
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_conflict"
    assert Order.objects.count() == 1


def test_create_order__without_a_key_creates_one_each_time(api):
    assert [post(api, "/api/orders", ORDER).status_code for _ in range(2)] == [201, 201]
    assert Order.objects.count() == 2


@pytest.mark.parametrize("key", ["   ", "k" * 256, "clé"])
def test_create_order__a_bad_key_is_400_naming_it_and_writes_nothing(api, key):
    response = post(api, "/api/orders", ORDER, **{"Idempotency-Key": key})
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "Idempotency-Key"
    assert not Order.objects.exists()


@pytest.mark.django_db(transaction=True)  # each thread's own connection must see the commits
def test_create_order__twelve_concurrent_posts_with_one_key_make_one_order(settings):
    settings.API_TOKEN = API_TOKEN
    ready = threading.Barrier(12)
    answers: list[tuple[int, int]] = []

    def send() -> None:
        try:
            client = api_client()
            ready.wait()
            response = post(client, "/api/orders", ORDER, **{"Idempotency-Key": "retried"})
            answers.append((response.status_code, response.json()["id"]))
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {status for status, _ in answers} == {201}
    assert len({order_id for _, order_id in answers}) == 1
    assert Order.objects.count() == 1
