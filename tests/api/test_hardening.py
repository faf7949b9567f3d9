"""Every bad input a clear 4xx with the documented JSON error, and nothing written."""

from __future__ import annotations

import json

import pytest
from django.core.cache import cache
from django.test import Client

from payments.models import ApiClient, ClientApiKey, Operation
from payments.shop.models import Order
from tests.support.api import API_TOKEN, api_client

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_throttles(settings):
    settings.API_TOKEN = API_TOKEN
    cache.clear()
    yield
    cache.clear()


def order(api: Client) -> int:
    answer = api.post(
        "/api/orders",
        data=json.dumps({"amount": 1999, "currency": "eur", "email": "a@example.com"}),
        content_type="application/json",
    )
    assert answer.status_code == 201, answer.content
    return answer.json()["id"]


def error_of(response) -> dict:
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    return response.json()["error"]


def nothing_written(before: tuple[int, int]) -> bool:
    return (Order.objects.count(), Operation.objects.count()) == before


def counts() -> tuple[int, int]:
    return Order.objects.count(), Operation.objects.count()


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("Bearer tökén", 401),  # non-ASCII: hmac.compare_digest raised TypeError (500)
        ("Bearer \u00a0", 401),
        ("Basic abc", 401),
        ("", 401),
        ("Bearer ab\x00cd", 401),  # a NUL reached PostgreSQL: DataError (500)
        ("Bearer ab\x7fcd.x", 401),
    ],
)
def test_auth__odd_headers_are_401_json(header, status):
    response = Client(headers={"Authorization": header} if header else {}).get("/api/orders/1")
    assert response.status_code == status
    assert error_of(response)["code"] == "unauthorized"
    assert response["WWW-Authenticate"] == 'Bearer realm="api"'


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        ("[" * 1000 + "]" * 1000, "application/json", 400, "malformed_json"),
        (
            json.dumps({"amount": 1, "currency": "eur", "email": "a\u0000@x.com"}),
            "application/json",
            400,
            "invalid_text",
        ),
        (
            '{"amount": 1, "currency": "eur", "email": "\\ud800@x.com"}',
            "application/json",
            400,
            "invalid_text",
        ),
        ("amount=1", "text/plain", 415, "unsupported_media_type"),
        (
            json.dumps({"amount": 1}).encode("utf-16"),
            "application/json; charset=utf-16",
            415,
            "unsupported_media_type",
        ),
        ("x" * (70 * 1024), "application/json", 413, "payload_too_large"),
    ],
    ids=["deep", "nul", "surrogate", "text-plain", "utf-16", "too-large"],
)
def test_create_order__bad_bodies_are_4xx_json_and_write_nothing(
    api, body, content_type, status, code
):
    before = counts()
    data = body.encode() if isinstance(body, str) else body
    response = api.generic("POST", "/api/orders", data, content_type=content_type)
    assert response.status_code == status, response.content[:300]
    assert error_of(response)["code"] == code
    assert nothing_written(before)


def test_checkout__nul_in_a_string_and_non_ascii_key_are_400(api):
    order_id = order(api)
    before = counts()
    nul = api.post(
        f"/api/orders/{order_id}/checkout",
        data=json.dumps({"payment_method": "pm_card\u0000visa"}),
        content_type="application/json",
        headers={"Idempotency-Key": "k1"},
    )
    assert (nul.status_code, error_of(nul)["code"]) == (400, "invalid_text")
    non_ascii = api.post(
        f"/api/orders/{order_id}/checkout",
        data=json.dumps({"payment_method": "pm_card_visa"}),
        content_type="application/json",
        headers={"Idempotency-Key": "clé"},
    )
    assert (non_ascii.status_code, error_of(non_ascii)["field"]) == (400, "Idempotency-Key")
    assert nothing_written(before)


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("get", "/api/orders", 405, "method_not_allowed"),
        ("put", "/api/orders", 405, "method_not_allowed"),
        ("post", "/api/orders/-1/checkout", 404, "not_found"),
        ("get", "/api/nothing/here", 404, "not_found"),
        ("get", "/api/operations/a%00b", 400, "invalid_text"),
    ],
)
def test_every_status_under_api_is_the_json_error(api, method, path, status, code):
    response = getattr(api, method)(path)
    assert response.status_code == status
    assert error_of(response)["code"] == code


def test_schema__openapi_3_served_without_auth():
    response = Client().get("/api/schema", headers={"Accept": "application/json"})
    assert response.status_code == 200
    schema = json.loads(response.content)
    assert schema["openapi"].startswith("3.")
    assert {"/api/orders", "/api/orders/{order_id}/refunds"} <= set(schema["paths"])


# --- per-client keys ---------------------------------------------------------------------


def client_with_key(name: str) -> tuple[Client, ClientApiKey]:
    api_client = ApiClient.objects.create(name=name)
    key_row, key = ClientApiKey.objects.create_key(name=f"{name} key", client=api_client)
    assert isinstance(key_row, ClientApiKey)
    return Client(headers={"Authorization": f"Bearer {key}"}), key_row


def test_client_keys__are_stored_hashed_with_a_visible_prefix():
    _, key_row = client_with_key("shop-a")
    assert key_row.prefix and key_row.hashed_key
    assert key_row.prefix in key_row.id and len(key_row.hashed_key) > 20


def test_client_keys__two_clients_never_share_an_idempotency_key(queue):
    shop_a, _ = client_with_key("shop-a")
    shop_b, _ = client_with_key("shop-b")
    order_a, order_b = order(shop_a), order(shop_b)
    answers = [
        shop.post(
            f"/api/orders/{order_id}/checkout",
            data=json.dumps({"payment_method": "pm_card_visa"}),
            content_type="application/json",
            headers={"Idempotency-Key": "order-1"},
        )
        for shop, order_id in ((shop_a, order_a), (shop_b, order_b))
    ]
    assert [a.status_code for a in answers] == [202, 202]  # no squatting, no conflict
    assert Operation.objects.filter(key="order-1").count() == 2
    assert shop_b.get("/api/operations/order-1").json()["entity"]["id"] == str(order_b)


def test_client_keys__a_revoked_key_is_refused_at_once():
    shop, key_row = client_with_key("shop-a")
    assert shop.get("/api/orders/1").status_code == 404  # accepted: the order is unknown
    key_row.revoked = True
    key_row.save()
    assert shop.get("/api/orders/1").status_code == 401


# --- throttling ----------------------------------------------------------------------------


def test_throttle__a_client_over_its_rate_gets_429_with_retry_after(settings, api):
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"client": "3/min", "failed_auth": "20/min"},
    }
    answers = [api.get("/api/orders/1").status_code for _ in range(4)]
    last = api.get("/api/orders/1")
    assert answers[:3] == [404, 404, 404] and answers[3] == 429
    assert error_of(last)["code"] == "rate_limited" and int(last["Retry-After"]) > 0


def test_throttle__wrong_tokens_lock_the_address_out_even_for_the_right_one():
    wrong = Client(headers={"Authorization": "Bearer wrong"})
    statuses = [wrong.get("/api/orders/1").status_code for _ in range(25)]
    assert statuses[:20] == [401] * 20 and set(statuses[20:]) == {429}
    right = api_client().get("/api/orders/1")
    assert right.status_code == 429


@pytest.mark.parametrize("length", ["abc", "-5", "1e3"])
def test_create_order__a_content_length_that_is_no_number_is_400(api, length):
    body = json.dumps({"amount": 1, "currency": "eur", "email": "a@x.io"})
    before = counts()
    response = api_client(raise_request_exception=False).generic(
        "POST", "/api/orders", body, content_type="application/json", CONTENT_LENGTH=length
    )
    assert response.status_code == 400, response.content[:200]
    assert error_of(response)["code"] == "bad_request"
    assert nothing_written(before)


def test_auth__a_key_outside_printable_ascii_counts_as_a_wrong_key(settings):
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"client": "600/min", "failed_auth": "2/min"},
    }
    nul = Client(headers={"Authorization": "Bearer ab\x00cd"}, raise_request_exception=False)
    assert [nul.get("/api/orders/1").status_code for _ in range(3)] == [401, 401, 429]
